"""The compiled CPU kernel's side of an ``AttentionPlan`` (``shared_prefix``): the segments
of one forward, built once and run by every layer.

A layer's kernel passes are ``(own, groups)``: ``groups`` (None without shared-prefix
groups) is each group's rows over its shared slots; ``own`` is every sequence's rows over
its keys past its group's prefix (all of them without one), continued from the groups'
state in the kernel (``o_init`` / ``lse_init``: the merge by log-sum-exp happens there).

The kernel places a segment's rows at its last keys' positions and applies a window by
differences of positions (row i of n at key index n_keys - n + i sees keys less than W
behind it): right for a segment whose keys are consecutive positions of one sequence ending
at its rows (from position 0, as ``flat``; or from later, as a window view's or an ``own``
segment past a shared prefix), wrong for a group's pass, whose rows stand at their members'
own positions past the shared keys. So a windowed layer runs over ``flat`` segments, every
sequence over all its keys, never the groups' passes (the group pass would need each row's
position; not done: a window mostly misses a long shared prefix anyway); a soft cap alone
is position-free and takes the groups' passes too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels import cpu_paged


@dataclass
class Segments:
    """Inputs of the CPU paged kernel (``cpu_paged``): segment s is rows
    ``q_rows[q_indptr[s]:q_indptr[s+1]]`` over slots ``kv_indices[kv_indptr[s]:...]``."""

    q_rows: torch.Tensor
    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    causal: bool = False  # extend: the keys end with the segment's own new tokens

    def attend(self, q, k_buf, v_buf, sm_scale, init=None, sliding_window=None,
               logit_cap=None):
        """(o, lse); ``init``: (o, lse) of an earlier pass these keys are merged into."""
        o_init, lse_init = init if init is not None else (None, None)
        return cpu_paged.paged_attention(q, k_buf, v_buf, self.q_rows, self.q_indptr,
                                         self.kv_indptr, self.kv_indices, sm_scale,
                                         self.causal, o_init, lse_init, sliding_window,
                                         logit_cap)


Passes = tuple[Segments, Segments | None]  # (own, groups)


def run_passes(passes: Passes, q, k_buf, v_buf, sm_scale, sliding_window=None,
               logit_cap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups over their shared prefixes, then every sequence's own keys continuing
    from that state. A window only over group-free passes (see the module doc)."""
    own, groups = passes
    if groups is None:
        return own.attend(q, k_buf, v_buf, sm_scale, None, sliding_window, logit_cap)
    if sliding_window is not None:
        raise ValueError("a sliding window needs group-free segments (AttentionPlan.flat)")
    init = groups.attend(q, k_buf, v_buf, sm_scale, None, None, logit_cap)
    return own.attend(q, k_buf, v_buf, sm_scale, init, None, logit_cap)


def decode_segments(qo, kv, kv_indptr, kv_indices, groups) -> Passes:
    """Kernel segments for decode: one per sequence (past its group's shared prefix) and
    one per group (its members' rows over the shared slots)."""
    dev = kv_indices.device
    n = len(qo) - 1
    rows = torch.tensor(qo[:-1], device=dev)
    ones = torch.arange(n + 1, device=dev)
    if not groups:
        return Segments(rows, ones, kv_indptr, kv_indices), None
    skip = _skips(groups, n)
    own = [kv_indices[kv[b] + skip[b]: kv[b + 1]] for b in range(n)]
    own_indptr = torch.tensor([0] + [len(x) for x in own], device=dev).cumsum(0)
    suffixes = Segments(rows, ones, own_indptr, torch.cat(own))
    g_rows = torch.tensor([qo[b] for _, members in groups for b in members], device=dev)
    g_qptr = torch.tensor([0] + [len(m) for _, m in groups], device=dev).cumsum(0)
    return suffixes, Segments(g_rows, g_qptr, *_group_slots(groups, kv, kv_indices))


def flat_decode_segments(qo, kv_indptr, kv_indices) -> Segments:
    """Decode: every sequence's row over all its keys (no groups; windowed layers)."""
    dev = kv_indices.device
    return Segments(torch.tensor(qo[:-1], device=dev), torch.arange(len(qo), device=dev),
                    kv_indptr, kv_indices)


def extend_segments(seqs, qo, kv, kv_indices, new_slots, skip=None) -> Segments:
    """Causal kernel segments: each sequence's rows over its prefix (past ``skip[b]`` shared
    slots) and new-token slots."""
    dev = kv_indices.device
    skip = skip or [0] * (len(qo) - 1)
    rows = torch.cat([torch.arange(qo[b], qo[b + 1], device=dev) for b in seqs])
    q_indptr = torch.tensor([0] + [qo[b + 1] - qo[b] for b in seqs], device=dev).cumsum(0)
    keys = [torch.cat((kv_indices[kv[b] + skip[b]: kv[b + 1]], new_slots[qo[b]: qo[b + 1]]))
            for b in seqs]
    kv_indptr = torch.tensor([0] + [len(x) for x in keys], device=dev).cumsum(0)
    return Segments(rows, q_indptr, kv_indptr, torch.cat(keys), causal=True)


def extend_group_segments(groups, qo, kv, kv_indices, new_slots) -> Passes:
    """Extend with shared prefixes on the kernel: each group's new rows over its shared
    slots (every row sees all of them), then each sequence's own keys causally, continued
    from the group's state (``run_passes``)."""
    dev = kv_indices.device
    skip = _skips(groups, len(qo) - 1)
    own = extend_segments(list(range(len(qo) - 1)), qo, kv, kv_indices, new_slots, skip)
    g_rows = [torch.arange(qo[b], qo[b + 1], device=dev) for _, m in groups for b in m]
    per_group = [sum(qo[b + 1] - qo[b] for b in m) for _, m in groups]
    g_qptr = torch.tensor([0] + per_group, device=dev).cumsum(0)
    return own, Segments(torch.cat(g_rows), g_qptr, *_group_slots(groups, kv, kv_indices))


def _skips(groups, n: int) -> list[int]:
    """Each sequence's shared-prefix length (0 outside every group)."""
    skip = [0] * n
    for length, members in groups:
        for b in members:
            skip[b] = length
    return skip


def _group_slots(groups, kv, kv_indices) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr, kv_indices) of the groups' passes: each group's shared slots."""
    dev = kv_indices.device
    g_kvptr = torch.tensor([0] + [length for length, _ in groups], device=dev).cumsum(0)
    g_slots = torch.cat([kv_indices[kv[m[0]]: kv[m[0]] + length] for length, m in groups])
    return g_kvptr, g_slots
