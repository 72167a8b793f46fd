"""Planned attention for the torch path, with shared prefixes read once ("cascade").

Every layer of one forward attends over the same ragged layout, so the index work
(padding, masks, which rows belong to whom) is done once per forward by
``AttentionPlan.build`` and every layer only gathers and multiplies.

When several sequences share their first ``L`` KV slots (a system prompt, a few-shot
prefix, the document of a RAG batch: the radix tree knows), the plain path gathers those
rows of K and V once per sequence. A plan with ``prefix_groups`` gathers them once per
group and every query row of the group attends to them in one matmul; the rest of each
sequence (its own tokens, and in extend the causal new tokens) goes through padded
passes, and the two partial softmaxes are merged by their log-sum-exp, exactly.

    prefix_groups = [(L, [b0, b1, ...]), ...]   # kv_indices[kv_indptr[b]:][:L] equal

Same results as ``reference.decode_attention`` / ``extend_attention`` (the tests check
both against a float64 oracle); only the order of summation differs.

Attention sinks (gpt-oss: a learned logit ``s`` per head in the softmax, with no value)
need no pass of their own: a row whose keys' log-sum-exp is ``lse`` loses the share
``exp(s) / (exp(lse) + exp(s))`` of its probability to the sink, so its output is the
plain one times ``sigmoid(lse - s)``. With sinks every pass keeps its log-sum-exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixlm.kernels import cpu_paged
from radixlm.kernels.padded_passes import (
    Padded,
    merge,
    padded_pass,
    padded_sdpa,
    plan_groups,
    plan_padded,
)
from radixlm.kernels.paged_segments import (
    Passes,
    Segments,
    decode_segments,
    extend_group_segments,
    extend_segments,
    flat_decode_segments,
    run_passes,
)
from radixlm.kernels.reference import _GROUP_KV_ELEMS, length_groups

PrefixGroups = list[tuple[int, list[int]]]


# Extend segments of at most this many new tokens go through the kernel (their K/V read
# in place, new tokens from the pool where store_kv just put them); longer ones through
# the padded passes, where torch's fused attention does the matmuls (MKL's sgemm) as fast
# or faster. Where that is depends on the CPU (`benchmarks/kernels_cpu.py --paged`, one
# thread). On an Intel CPU with AMX, two runs: over a 512-token prefix the kernel is
# 2.6-3.7x faster at 8 new tokens, 1.13-1.48x at 128, 1.03-1.18x at 256, even at 512,
# 0.96x at 1024; from an empty prefix 1.12-1.35x at 256, 0.55-0.75x at 1024-2048. On an
# AMD EPYC (Zen 4, no AMX), one run: 0.82x at 4 x 512 + 256, 1.38x at 512 + 512, 1.35x at
# 512 + 1024, from an empty prefix 1.49x at 512, 1.05x at 1024, 0.89x at 2048; in the engine
# there (float32, small preset, two threads, two alternating rounds) a limit of 1024 took
# the extend attention of the shared-prefix workload from 0.52-0.58 s to 0.39-0.46 s and of
# the variable one (16-1024 tokens) from 1.31-1.35 s to 0.71-0.76 s. With the kernel's
# packed float32 path (AVX-512 builds, csrc/packed_attention.cpp) the same EPYC, prompts
# from an empty prefix, padded / kernel time: 1.73x at 1024, 1.39x at 2048, 1.08x at 4096
# on one thread, 1.41x, 1.50x, 1.14x on two; 2048 new over 2048 cached 1.67x / 1.87x (the
# FMA path: 0.96x / 1.08x at 2048, 0.76x / 0.94x at 4096). On an AMD EPYC without AVX-512
# (Zen 3, AVX2: the packed path's AVX2 form, two threads, one run), padded / kernel time:
# 1.05x at 1024 from an empty prefix, 1.02x at 2048, 0.81x at 4096; 2048 over 2048 cached
# 1.09x, 4 x 1024 over 512 1.19x. CPUs with AMX tiles take 256, others with AVX-512 4096,
# with AVX2 2048, the rest 1024.
KERNEL_MAX_EXTEND_ROWS = (256 if torch.cpu._is_amx_tile_supported()
                          else 4096 if torch.cpu._is_avx512_supported()
                          else 2048 if torch.cpu._is_avx2_supported() else 1024)
# The same for a bfloat16 model: the padded passes then run torch's fused attention in
# bf16 (AMX / AVX512-BF16 matmuls) while the kernel computes in float32 FMAs. Over a
# 512-token prefix (8 sequences, 1 thread, busy machine) the kernel took 0.31x the
# padded time at 4 new tokens, 0.92x at 16, 1.5x at 32, 2x at 64. A CPU without bf16
# instructions has no such matmuls (torch's bf16 attention converts element by element):
# float32's limit there (AMD Zen 3, the shared-prefix workload in bf16: the extend
# attention 1.51 s of CPU with 16, 0.93 with 2,048). The CPU test is model_config.cpu_has_bf16's
# (kernels/ imports nothing of the runtime; a test holds the two together).
KERNEL_MAX_EXTEND_ROWS_BF16 = (16 if torch.cpu._is_avx512_bf16_supported()
                               or torch.cpu._is_amx_tile_supported()
                               else KERNEL_MAX_EXTEND_ROWS)
# Layers with a sliding window or a soft cap take the kernel (AttentionPlan.flat) at any
# number of rows: their alternative is masked_attention, not the padded passes, and the
# kernel was 3-32x faster than it over 256-4096 new tokens (a window of 256: it skips the
# key blocks behind each row; a cap of 50 alone: 4.6-15x), float32 and bfloat16 alike
# (12 / 4 heads of 64, 2 threads, busy machine; docs/benchmarks.md has the model's figure).
# An extend with shared-prefix groups goes through the kernel (each group's pass, then each
# sequence's own keys continuing from it) when no group has more new rows than this. On AMD
# Zen 4 (no AMX; small preset, float32, 2 threads, the engine's whole run of 4 groups x 8
# requests of a 512-token shared prefix + n new tokens, 8 out, three alternations): n = 64
# (512 rows a group) 3.80 s against 4.27 through the padded passes, n = 256 (2,048 rows)
# 9.87 against 14.14 (the FMA path alone, RADIXLM_CPU_PACKED=0: 9.99 against 14.18), n =
# 1,024 (8,192 rows) 35.0 against 67.2: no group is too large there. CPUs with AMX tiles,
# where torch's fused attention overtook the kernel from 256 rows, keep 256.
KERNEL_MAX_GROUP_ROWS = 256 if torch.cpu._is_amx_tile_supported() else math.inf
# There a group gets a pass of its own only when its shared prefix has at least this many
# keys per new row of a member (on average); the others' members read their shared keys in
# their own segments. A member of many rows already reuses each key block over its tiles,
# and the group's pass then costs more (its rows' state, a second pass) than the reads it
# saves. Group / flat time, 4 groups x 8 members over a shared prefix of L, 12 / 4 heads,
# 2 threads, AMD Zen 4: float32 (FMA path) at L = 544 0.96x with 4 new rows a member, 1.06x
# at 8, 1.18x at 16-32; at L = 2,048 0.93x at 4, 0.96x at 8, 1.04x at 16-32; at L = 128
# 1.08-1.33x at 4-32. A bf16 q (the tiles) at L = 544 0.81x at 4, 0.93x at 8, 0.97x at 16,
# 1.07-1.15x at 32; at L = 2,048 0.64-0.93x at 4-32; at L = 128 1.04x at 4, 1.35-1.48x at
# 8-32. Decode rows (one a member) keep the groups: 0.74-0.88x.
KERNEL_GROUP_KEYS_PER_ROW = 128
KERNEL_GROUP_KEYS_PER_ROW_BF16 = 64


@dataclass
class AttentionPlan:
    """Index tensors of one forward's attention, shared by every layer.

    On a CPU with the compiled kernel (``paged_kernel``), ``paged`` reads K/V in place:
    in decode every sequence (past its shared prefix, then each group over its shared
    prefix, merged); in extend without groups the sequences of at most
    ``KERNEL_MAX_EXTEND_ROWS`` new tokens (``KERNEL_MAX_EXTEND_ROWS_BF16`` in a 16-bit
    model), causally; in extend with groups (every sequence within those rows, no group past
    ``KERNEL_MAX_GROUP_ROWS`` unless on the tiles) the same, each group worth it
    (``KERNEL_GROUP_KEYS_PER_ROW``) first over its shared prefix. The padded passes gather
    K/V rows once per layer for the rest.

    Layers with a sliding window or a soft cap run in the kernel too (``masked_passes``),
    whatever the rows' number: ``flat`` is every sequence over all its keys from position 0
    (no groups: a window needs positions); a cap alone takes ``paged`` when it has every
    row. Without the kernel (or, in extend, ``new_slots``) they take ``masked_attention``."""

    extend: bool
    shared: Padded | None  # every group as one padded pass: its rows over its shared KV
    padded: list[Padded]  # each sequence past its shared prefix (all of it if none)
    paged: Passes | None = None  # (suffixes, groups)
    flat: Segments | None = None  # every row, each sequence's keys from position 0
    amx: bool = False  # the kernel takes q in bf16 (AMX tiles for its larger tasks)

    def masked_passes(self, sliding_window: int | None) -> Passes | None:
        """The kernel passes of a layer with a window and/or a cap (None: no kernel in
        this plan; the masked path then). A cap alone keeps the groups."""
        if self.flat is None:
            return None
        if sliding_window is None and self.paged is not None and not self.padded:
            return self.paged
        return self.flat, None

    @classmethod
    def build(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              kv_elems_per_token: int, extend: bool,
              prefix_groups: PrefixGroups | None = None,
              paged_kernel: bool = False,
              new_slots: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32, amx: bool = False) -> AttentionPlan:
        """``paged_kernel``: attention through ``cpu_paged`` (CPU, K/V in
        ``cpu_paged.KV_DTYPES``, kernel built; q in any float dtype, widened to float32)
        where it pays; in extend it needs ``new_slots``, the pool slots of the new tokens
        (``out_cache_loc``), stored before attention. ``dtype``: the model's (q's).
        ``amx`` (``ModelRunner.amx_attention``: a bf16 model and pool, ``cpu_paged.amx()``):
        the kernel takes q in bf16 and every extend row, whatever the chunk's length."""
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        groups = prefix_groups or []
        check_prefix_groups(groups, kv, kv_indices)
        amx = amx and paged_kernel
        if paged_kernel and not extend:
            paged = decode_segments(qo, kv, kv_indptr, kv_indices, groups)
            flat = flat_decode_segments(qo, kv_indptr, kv_indices) if groups else paged[0]
            return cls(extend, None, [], paged, flat, amx)
        q_lens = [qo[b + 1] - qo[b] for b in range(len(qo) - 1)]
        if not (paged_kernel and extend and new_slots is not None):
            return cls(extend, *_padded_plan(list(range(len(q_lens))), qo, kv, kv_indices,
                                             groups, kv_elems_per_token, extend))
        most = (math.inf if amx else KERNEL_MAX_EXTEND_ROWS if dtype == torch.float32
                else KERNEL_MAX_EXTEND_ROWS_BF16)
        everything = list(range(len(q_lens)))
        fits = max(q_lens, default=0) <= most
        if groups:
            flat = extend_segments(everything, qo, kv, kv_indices, new_slots)
            group_rows = max(sum(q_lens[b] for b in m) for _, m in groups)
            if fits and (amx or group_rows <= KERNEL_MAX_GROUP_ROWS):
                # the groups worth a pass, then each sequence's own keys from its state
                kept = _groups_worth_a_pass(groups, q_lens, amx)
                paged = (extend_group_segments(kept, qo, kv, kv_indices, new_slots) if kept
                         else (flat, None))
                return cls(extend, None, [], paged, flat, amx)
            return cls(extend, *_padded_plan(everything, qo, kv, kv_indices, groups,
                                             kv_elems_per_token, extend), flat=flat, amx=amx)
        small = [b for b in everything if q_lens[b] <= most]
        rest = [b for b in everything if q_lens[b] > most]
        paged = (extend_segments(small, qo, kv, kv_indices, new_slots), None) if small else None
        shared, padded = _padded_plan(rest, qo, kv, kv_indices, [], kv_elems_per_token, extend)
        flat = paged[0] if paged and not rest else extend_segments(everything, qo, kv,
                                                                   kv_indices, new_slots)
        return cls(extend, shared, padded, paged, flat, amx)


def _groups_worth_a_pass(groups: PrefixGroups, q_lens: list[int], amx: bool) -> PrefixGroups:
    """The extend groups whose shared prefix is long against their members' new rows
    (``KERNEL_GROUP_KEYS_PER_ROW``; ``_BF16`` for a bf16 q on the tiles)."""
    per_row = KERNEL_GROUP_KEYS_PER_ROW_BF16 if amx else KERNEL_GROUP_KEYS_PER_ROW
    return [(length, members) for length, members in groups
            if length * len(members) >= per_row * sum(q_lens[b] for b in members)]


def _padded_plan(rest, qo, kv, kv_indices, groups, kv_elems_per_token, extend
                 ) -> tuple[Padded | None, list[Padded]]:
    """(shared, padded): the groups as one padded pass, the sequences ``rest`` (past their
    group's prefix) in padded passes of similar lengths."""
    dev = kv_indices.device
    skip = [0] * (len(qo) - 1)
    rows, slots = [], []
    for length, members in groups:
        for b in members:
            skip[b] = length
        rows.append(torch.cat([torch.arange(qo[b], qo[b + 1]) for b in members]).to(dev))
        slots.append(kv_indices[kv[members[0]]: kv[members[0]] + length])
    shared = plan_groups(rows, slots) if groups else None
    q_lens = [qo[b + 1] - qo[b] for b in range(len(qo) - 1)]
    kv_lens = [kv[b + 1] - kv[b] - skip[b] for b in range(len(kv) - 1)]
    # a new prompt with nothing cached takes torch's causal attention (is_causal skips the
    # key blocks past each query block: about half the work of a mask at 1,024 tokens and
    # up), so it goes in a pass only with prompts of its own length (no padding, no mask)
    new = {b for b in rest if extend and kv_lens[b] == 0 and not skip[b]}
    fresh: dict[int, list[int]] = {}
    for b in sorted(new):
        fresh.setdefault(q_lens[b], []).append(b)
    others = [b for b in rest if b not in new]
    subs = [[others[i] for i in sub]
            for sub in length_groups([q_lens[b] for b in others], [kv_lens[b] for b in others],
                                     kv_elems_per_token)]
    for length, members in fresh.items():  # as many as length_groups would put together
        per = max(1, _GROUP_KV_ELEMS // (length * kv_elems_per_token))
        subs += [members[i:i + per] for i in range(0, len(members), per)]
    padded = []
    for g in subs:
        p = plan_padded([qo[b] for b in g], [kv[b] + skip[b] for b in g],
                         [q_lens[b] for b in g], [kv_lens[b] for b in g], kv_indices, extend)
        p.needs_lse = any(skip[b] for b in g)
        padded.append(p)
    return shared, padded


def check_prefix_groups(groups: PrefixGroups, kv: list[int], kv_indices: torch.Tensor) -> None:
    """Raise ValueError unless every member of a group starts with the same L slots."""
    seen: set[int] = set()
    for length, members in groups:
        if length <= 0 or not members:
            raise ValueError(f"a prefix group needs L > 0 and members, got {length}, {members}")
        if seen.intersection(members):
            raise ValueError(f"sequence(s) {sorted(seen.intersection(members))} in two groups")
        seen.update(members)
        for b in members:
            if kv[b + 1] - kv[b] < length:
                raise ValueError(f"sequence {b} has fewer than L={length} KV entries")
        head = kv_indices[kv[members[0]]: kv[members[0]] + length]
        for b in members[1:]:  # views compared in place: no index tensor built
            if not torch.equal(kv_indices[kv[b]: kv[b] + length], head):
                raise ValueError(f"sequence {b} does not share its first {length} KV slots")


def planned_attention(plan: AttentionPlan, q, k, v, k_buf, v_buf, sm_scale, out=None,
                      sinks=None, sliding_window=None, logit_cap=None):
    """Attention of one layer along ``plan``: q [N, Hq, D]; k/v [N, Hkv, D] in extend;
    ``sinks`` [Hq] (see the module doc); a window or a cap: the kernel's passes alone
    (``plan.masked_passes`` must not be None).

    The compiled kernel takes q in float32: a bfloat16 / float16 q is widened for it (its
    output is float32, as every pass's is; narrowed to q's dtype at the end). The padded
    passes run in q's dtype (torch's fused attention in bf16: oneDNN's AMX kernels)."""
    n, hq, d = q.shape
    if sliding_window is not None or logit_cap is not None:
        passes = plan.masked_passes(sliding_window)
        if passes is None:
            raise ValueError("this plan has rows off the kernel: a window or a cap takes "
                             "masked_attention")
        o, lse = _kernel_pass(passes, q, k_buf, sm_scale, v_buf, plan.amx, sliding_window,
                              logit_cap)
        return _finish(o, lse, q, out, sinks)
    if plan.paged is not None:  # its rows, and every row's lse (-inf where not its own)
        o, lse = _kernel_pass(plan.paged, q, k_buf, sm_scale, v_buf, plan.amx)
    else:
        o = torch.empty((n, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((n, hq), dtype=torch.float32, device=q.device)
    for p in plan.padded:
        kn, vn = (k, v) if plan.extend else (None, None)
        if p.needs_lse or sinks is not None:
            padded_pass(p, q, kn, vn, k_buf, v_buf, sm_scale, o, lse)
        else:
            padded_sdpa(p, q, kn, vn, k_buf, v_buf, sm_scale, o)
    if plan.shared is not None:
        sh = plan.shared
        o_s = torch.empty((n, hq, d), dtype=torch.float32, device=q.device)
        lse_s = torch.empty((n, hq), dtype=torch.float32, device=q.device)
        padded_pass(sh, q, None, None, k_buf, v_buf, sm_scale, o_s, lse_s)
        rows = sh.out_rows
        o[rows], lse[rows] = merge(o_s[rows], lse_s[rows], o[rows], lse[rows])
    return _finish(o, lse, q, out, sinks)


def _kernel_pass(passes: Passes, q, k_buf, sm_scale, v_buf, amx=False, sliding_window=None,
                 logit_cap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's passes; with ``amx`` a bf16 q goes in as it is (AMX tiles for the
    larger tasks over a bf16 pool, widened in the kernel for the rest)."""
    if k_buf.dtype not in cpu_paged.KV_DTYPES:
        raise ValueError(f"the paged CPU kernel takes K/V in {cpu_paged.KV_DTYPES}, got "
                         f"{k_buf.dtype}: build the plan with paged_kernel=False")
    q_in = q if amx and q.dtype == torch.bfloat16 else q.float()
    return run_passes(passes, q_in.contiguous(), k_buf, v_buf, sm_scale, sliding_window,
                      logit_cap)


def _finish(o, lse, q, out, sinks) -> torch.Tensor:
    """Sinks from each row's log-sum-exp, then q's dtype, into ``out`` when given."""
    if sinks is not None:  # [N, Hq]: each row's share of the probability left to its keys
        o = o * torch.sigmoid(lse - sinks.float())[..., None]
    o = o.to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
