"""The CPU paged-attention kernel (``kernels/cpu_paged``, compiled C++ reading K/V from
the pool in place) against a float64 oracle: decode over pages of several sizes, GQA
ratios, head dims on and off its vector path, empty segments, and shared-prefix groups
merged by log-sum-exp; outputs NaN-poisoned so a skipped row cannot pass; pools stored in
bfloat16 / float16 / float8_e5m2 against float64 over the values they hold."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from radixlm import kernels
from radixlm.kernels import cpu_paged, reference
from radixlm.kernels.shared_prefix import AttentionPlan


def test_kernel_builds_where_a_compiler_exists():
    # CI machines have g++: there the kernel must be built and loaded, not silently skipped
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_paged.available()


def _dense_f64(q, k_buf, v_buf, kv_indptr, kv_indices, scale):
    """The float64 oracle: the reference twin on float64 copies."""
    return reference.decode_attention(q.double(), k_buf.double(), v_buf.double(), kv_indptr,
                                      kv_indices, scale)


def _shared_batch(seed, hq, hkv, d):
    """Sequences 0-2 share their first 40 slots, 3-4 their first 17, 5 shares none;
    groups = [(40, [0, 1, 2]), (17, [3, 4])]."""
    q, kb, vb, kvp, kvi = _paged_batch(seed, [45, 41, 63, 26, 18, 30], 1, hq, hkv, d)
    seqs = list(kvi.split(torch.diff(kvp).tolist()))
    for b in (1, 2):
        seqs[b][:40] = seqs[0][:40]
    seqs[4][:17] = seqs[3][:17]
    return q, kb, vb, kvp, torch.cat(seqs), [(40, [0, 1, 2]), (17, [3, 4])]


needs_kernel = pytest.mark.skipif(not cpu_paged.available(), reason="kernel not built")


def _paged_batch(seed, lens, page_size, hq, hkv, d):
    """Sequences of ``lens`` tokens in a pool of shuffled pages (as the allocator does)."""
    g = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in lens]
    order = torch.randperm(sum(pages) + 3, generator=g)
    seqs, p = [], 0
    for n, k in zip(lens, pages):
        slots = (order[p: p + k, None] * page_size + torch.arange(page_size)).reshape(-1)
        seqs.append(slots[:n])
        p += k
    size = (sum(pages) + 3) * page_size
    kv_indptr = torch.tensor([0] + lens).cumsum(0)
    q = torch.randn(len(lens), hq, d, generator=g)
    k_buf, v_buf = torch.randn(size, hkv, d, generator=g), torch.randn(size, hkv, d, generator=g)
    return q, k_buf, v_buf, kv_indptr, torch.cat(seqs)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (8, 1)])
@pytest.mark.parametrize("d", [64, 40])  # 40: not a multiple of 16, the scalar path
def test_decode_matches_f64(page_size, heads, d):
    hq, hkv = heads
    lens = [1, 7, 64, 65, 300, 129]
    q, kb, vb, kvp, kvi = _paged_batch(page_size + d, lens, page_size, hq, hkv, d)
    qo = torch.arange(len(lens) + 1)
    plan = AttentionPlan.build(qo, kvp, kvi, hkv * d, extend=False, paged_kernel=True)
    assert plan.paged is not None and not plan.padded
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, kb, vb, kvp, kvi, 0.21, backend="torch", out=out, plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = _dense_f64(q, kb, vb, kvp, kvi, 0.21)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("use_groups", [False, True])
def test_decode_with_shared_prefixes_matches_f64(heads, use_groups):
    hq, hkv = heads
    for seed in range(3):
        q, kb, vb, kvp, kvi, groups = _shared_batch(seed, hq, hkv, 32)
        qo = torch.arange(len(kvp))
        plan = AttentionPlan.build(qo, kvp, kvi, hkv * 32, extend=False, paged_kernel=True,
                                   prefix_groups=groups if use_groups else None)
        assert (plan.paged[1] is not None) == use_groups
        out = torch.full_like(q, float("nan"))
        kernels.decode_attention(q, kb, vb, kvp, kvi, 0.17, backend="torch", out=out,
                                 plan=plan)
        ref = _dense_f64(q, kb, vb, kvp, kvi, 0.17)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@needs_kernel
def test_a_sequence_that_is_all_shared_prefix():
    # a member whose whole KV is the group's prefix has an empty own segment (lse -inf);
    # the merge must return the group's result alone
    q, kb, vb, kvp, kvi = _paged_batch(0, [20, 20], 4, 4, 2, 32)
    kvi[20:] = kvi[:20]
    qo = torch.arange(3)
    plan = AttentionPlan.build(qo, kvp, kvi, 64, extend=False, paged_kernel=True,
                               prefix_groups=[(20, [0, 1])])
    out = kernels.decode_attention(q, kb, vb, kvp, kvi, 0.3, backend="torch", plan=plan)
    ref = _dense_f64(q, kb, vb, kvp, kvi, 0.3)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@needs_kernel
def test_empty_segments_and_lse():
    # segment 1 has no keys: its row's output is 0 and its log-sum-exp -inf; the others'
    # log-sum-exp equals the float64 one
    q, kb, vb, _, _ = _paged_batch(1, [5], 1, 4, 2, 16)
    q = torch.randn(3, 4, 16)
    kvi = torch.tensor([0, 1, 2, 3, 4, 1, 2])
    o, lse = cpu_paged.paged_attention(q, kb, vb, torch.tensor([0, 1, 2]),
                                       torch.tensor([0, 1, 2, 3]), torch.tensor([0, 5, 5, 7]),
                                       kvi, 0.5)
    assert torch.equal(o[1], torch.zeros(4, 16)) and torch.isinf(lse[1]).all()
    for row, idx in ((0, kvi[:5]), (2, kvi[5:])):
        keys = kb[idx].double().repeat_interleave(2, 1)
        s = torch.einsum("hd,lhd->hl", q[row].double(), keys) * 0.5
        torch.testing.assert_close(lse[row].double(), s.logsumexp(-1), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("d", [64, 40])  # the vector path and the scalar one
@pytest.mark.parametrize("causal", [False, True])
def test_a_pass_continued_from_another_equals_one_pass_over_both(d, causal):
    """o_init / lse_init: the second pass's softmax starts from the first's state, so two
    passes over disjoint keys equal one pass over all of them (the shared-prefix merge);
    a row in no segment of the second pass keeps the first's output; a row the first pass
    never saw (lse -inf) starts empty."""
    torch.manual_seed(3)
    hq, hkv = 4, 2
    kb, vb = torch.randn(64, hkv, d), torch.randn(64, hkv, d)
    q = torch.randn(5, hq, d)
    first, second = torch.randperm(64)[:20], torch.randperm(64)[:9]
    rows = torch.tensor([0, 1, 2, 3])  # row 4: in no segment of the second pass

    def attend(rows, keys, causal=False, init=(None, None)):
        return cpu_paged.paged_attention(q, kb, vb, rows, torch.tensor([0, len(rows)]),
                                         torch.tensor([0, len(keys)]), keys, 0.3, causal,
                                         *init)

    o1, l1 = attend(torch.arange(5), first)
    o2, l2 = attend(rows, second, causal, (o1, l1))
    want, want_lse = attend(rows, torch.cat((first, second)), causal)
    torch.testing.assert_close(o2[:4], want[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l2[:4], want_lse[:4], rtol=1e-5, atol=1e-5)
    assert torch.equal(o2[4], o1[4]) and torch.equal(l2[4], l1[4])
    o1[3], l1[3] = 0.0, float("-inf")  # row 3: nothing before
    o3, l3 = attend(rows, second, causal, (o1, l1))
    alone, alone_lse = attend(rows, second, causal)
    torch.testing.assert_close(o3[3], alone[3], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l3[3], alone_lse[3], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_queries_float32_or_bfloat16():
    q, kb, vb, kvp, kvi = _paged_batch(2, [3, 4], 1, 4, 2, 16)
    idx = torch.arange(2), torch.arange(3), kvp, kvi
    with pytest.raises(RuntimeError, match="q: float32 or bfloat16"):
        cpu_paged.paged_attention(q.half(), kb, vb, *idx, 0.2)
    # a bf16 q in tasks too small for AMX tiles: widened, the float32 path's very result
    qb = q.bfloat16()
    o, lse = cpu_paged.paged_attention(qb, kb, vb, *idx, 0.2)
    o32, lse32 = cpu_paged.paged_attention(qb.float(), kb, vb, *idx, 0.2)
    assert torch.equal(o, o32) and torch.equal(lse, lse32)
    with pytest.raises(RuntimeError, match="float8_e5m2, got"):  # e4m3: the torch path's
        cpu_paged.paged_attention(q, kb.to(torch.float8_e4m3fn), vb.to(torch.float8_e4m3fn),
                                  *idx, 0.2)


@needs_kernel
@pytest.mark.parametrize("dtype", cpu_paged.KV_DTYPES)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256, 40])  # every vector width, and scalar
@pytest.mark.parametrize("causal", [False, True])
def test_narrow_pools_match_f64_over_their_rounded_values(dtype, d, causal):
    # K/V stored in a narrow dtype are widened as loaded: the output equals float64
    # attention over the very values the pool holds (rounding is the pool's, not the kernel's)
    assert dtype in cpu_paged.KV_DTYPES
    lens = [1, 70, 129, 5]
    q, kb, vb, kvp, kvi = _paged_batch(d, lens, 16, 12, 4, d)
    kb, vb = (kb * 0.5).to(dtype), (vb * 0.5).to(dtype)
    rows = [min(n, 3) if causal else 1 for n in lens]  # causal: the last rows of each
    qo = torch.tensor([0] + rows).cumsum(0)
    q = torch.randn(int(qo[-1]), 12, d, generator=torch.Generator().manual_seed(d))
    o, lse = cpu_paged.paged_attention(q, kb, vb, torch.arange(len(q)), qo, kvp, kvi, 0.3,
                                       causal)
    kd, vd = kb.double(), vb.double()
    for s, n in enumerate(lens):
        keys = kvi[kvp[s]: kvp[s + 1]]
        for i, row in enumerate(range(qo[s], qo[s + 1])):
            seen = keys[: n - rows[s] + i + 1] if causal else keys
            kk = kd[seen].repeat_interleave(3, 1)
            sc = torch.einsum("hd,lhd->hl", q[row].double(), kk) * 0.3
            ref = torch.einsum("hl,lhd->hd", sc.softmax(-1), vd[seen].repeat_interleave(3, 1))
            torch.testing.assert_close(o[row].double(), ref, rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(lse[row].double(), sc.logsumexp(-1), rtol=2e-5,
                                       atol=2e-5)


def _extend_batch(seed, prefix_lens, q_lens, hq, hkv, d):
    """Each sequence: its prefix in the pool, then its new tokens, whose K/V are stored in
    the pool (at new_slots) before attention, as the model does."""
    q, kb, vb, _, slots = _paged_batch(seed, [p + n for p, n in zip(prefix_lens, q_lens)], 4,
                                       hq, hkv, d)
    seqs = slots.split([p + n for p, n in zip(prefix_lens, q_lens)])
    kvi = torch.cat([s[:p] for s, p in zip(seqs, prefix_lens)])
    new_slots = torch.cat([s[p:] for s, p in zip(seqs, prefix_lens)])
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(seed))
    kvp = torch.tensor([0] + prefix_lens).cumsum(0)
    qo = torch.tensor([0] + q_lens).cumsum(0)
    return q, kb[new_slots], vb[new_slots], kb, vb, qo, kvp, kvi, new_slots


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (8, 1)])
@pytest.mark.parametrize("max_rows", [3, 256])  # 3: long segments take the padded passes
def test_extend_matches_f64(heads, max_rows, monkeypatch):
    from radixlm.kernels import shared_prefix

    monkeypatch.setattr(shared_prefix, "KERNEL_MAX_EXTEND_ROWS", max_rows)
    hq, hkv = heads
    prefix_lens, q_lens = [0, 5, 70, 0, 130, 1], [1, 3, 9, 17, 2, 65]
    q, k, v, kb, vb, qo, kvp, kvi, new_slots = _extend_batch(3, prefix_lens, q_lens, hq, hkv, 32)
    plan = AttentionPlan.build(qo, kvp, kvi, hkv * 32, extend=True, paged_kernel=True,
                               new_slots=new_slots)
    in_kernel = sum(n <= max_rows for n in q_lens)
    assert len(plan.paged[0].q_indptr) - 1 == in_kernel
    out = torch.full_like(q, float("nan"))
    kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.19, backend="torch", out=out,
                             plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = reference.extend_attention(q.double(), k.double(), v.double(), kb.double(),
                                     vb.double(), qo, kvp, kvi, 0.19)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@needs_kernel
@pytest.mark.parametrize("prefix_len", [8, 12])  # all of the members' prefix shared, or not
def test_extend_with_groups_runs_in_the_kernel(prefix_len, monkeypatch):
    """Each group's new rows over its shared slots, then each sequence's own keys causally
    from that state (o_init / lse_init): equal to the float64 reference; a member past the
    kernel's row limit, or a group past its limit, sends the whole batch to the padded
    passes."""
    from radixlm.kernels import shared_prefix

    monkeypatch.setattr(shared_prefix, "KERNEL_GROUP_KEYS_PER_ROW", 0)  # 8 keys, 2.5 rows
    q, k, v, kb, vb, qo, kvp, kvi, new_slots = _extend_batch(
        4, [prefix_len, prefix_len, 5], [2, 3, 4], 4, 2, 16)
    kvi[prefix_len:prefix_len + 8] = kvi[:8]  # sequences 0 and 1 share their first 8 slots
    groups = [(8, [0, 1])]
    plan = AttentionPlan.build(qo, kvp, kvi, 32, extend=True, paged_kernel=True,
                               new_slots=new_slots, prefix_groups=groups)
    assert plan.paged is not None and plan.paged[1] is not None and not plan.padded
    out = torch.full_like(q, float("nan"))
    kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.25, backend="torch", out=out,
                             plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = reference.extend_attention(q.double(), k.double(), v.double(), kb.double(),
                                     vb.double(), qo, kvp, kvi, 0.25)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    for limit, rows in (("KERNEL_MAX_EXTEND_ROWS", 3), ("KERNEL_MAX_GROUP_ROWS", 4)):
        # a member past the row limit, or a group past the group limit (its 5 new rows);
        # each limit alone, the groups' keys-per-row patch above kept
        with monkeypatch.context() as m:
            m.setattr(shared_prefix, limit, rows)
            plan = AttentionPlan.build(qo, kvp, kvi, 32, extend=True, paged_kernel=True,
                                       new_slots=new_slots, prefix_groups=groups)
            assert plan.paged is None and plan.shared is not None


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_an_extend_group_gets_its_pass_only_over_a_prefix_long_against_its_rows(amx):
    """A group's pass in extend needs KERNEL_GROUP_KEYS_PER_ROW (_BF16 for a bf16 q on the
    tiles) shared keys per new row of a member: 64 shared keys with decode rows (one a
    member) keep it; with 20 new rows a member its members read the keys in their own
    segments. Either way the float64 reference's result."""
    from radixlm.kernels import shared_prefix

    per_row = (shared_prefix.KERNEL_GROUP_KEYS_PER_ROW_BF16 if amx
               else shared_prefix.KERNEL_GROUP_KEYS_PER_ROW)
    for rows, grouped in (([1, 1, 1, 1], True), ([20, 20, 3, 4], False)):
        shared = per_row  # one row a member: exactly enough
        q, k, v, kb, vb, qo, kvp, kvi, new_slots = _extend_batch(
            5, [shared + 3, shared, shared + 7, 9], rows, 4, 2, 16)
        seqs = list(kvi.split(torch.diff(kvp).tolist()))
        seqs[1][:shared], seqs[2][:shared] = seqs[0][:shared], seqs[0][:shared]
        kvi = torch.cat(seqs)
        dtype = torch.bfloat16 if amx else torch.float32
        plan = AttentionPlan.build(qo, kvp, kvi, 32, extend=True, paged_kernel=True,
                                   new_slots=new_slots, prefix_groups=[(shared, [0, 1, 2])],
                                   dtype=dtype, amx=amx)
        assert plan.paged is not None and not plan.padded
        assert (plan.paged[1] is not None) == grouped
        assert plan.paged[0].kv_indptr[-1] == (
            len(kvi) + int(new_slots.numel()) - (3 * shared if grouped else 0))
        out = torch.full_like(q, float("nan"))
        kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.25, backend="torch",
                                 out=out, plan=plan)
        ref = reference.extend_attention(q.double(), k.double(), v.double(), kb.double(),
                                         vb.double(), qo, kvp, kvi, 0.25)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@needs_kernel
def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    # a library linked with -ffast-math turns on flush-to-zero for the whole process
    # (hypothesis, numpy and Python floats would then lose subnormals)
    tiny, one = 5e-324, 1.0
    assert tiny * one == 5e-324
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0


_PORTABLE_CHECK = """
import sys, torch
from radixlm.kernels import cpu_paged
cpu_paged.FLAGS[:] = [f if f != "-march=native" else sys.argv[1] for f in cpu_paged.FLAGS]
assert cpu_paged.available(), "the build failed"
g = torch.Generator().manual_seed(0)
for dtype in cpu_paged.KV_DTYPES:
    for d in (64, 40):
        kb = (torch.randn(300, 2, d, generator=g) * 0.5).to(dtype)
        vb = (torch.randn(300, 2, d, generator=g) * 0.5).to(dtype)
        q = torch.randn(2, 6, d, generator=g)
        kvi = torch.randperm(300, generator=g)[:150]
        for window, cap in ((None, None), (50, 3.0)):  # the last 50 keys, capped scores
            o, _ = cpu_paged.paged_attention(q, kb, vb, torch.arange(2),
                                             torch.tensor([0, 1, 2]),
                                             torch.tensor([0, 70, 150]), kvi, 0.3,
                                             sliding_window=window, logit_cap=cap)
            for s, (a, b) in enumerate(((0, 70), (70, 150))):
                a = max(a, b - (window or b))
                keys, vals = kb[kvi[a:b]].double(), vb[kvi[a:b]].double()
                sc = torch.einsum("hd,lhd->hl", q[s].double(), keys.repeat_interleave(3, 1))
                sc = sc * 0.3 if cap is None else torch.tanh(sc * 0.3 / cap) * cap
                ref = torch.einsum("hl,lhd->hd", sc.softmax(-1), vals.repeat_interleave(3, 1))
                torch.testing.assert_close(o[s].double(), ref, rtol=2e-5, atol=2e-5)
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_builds_for_other_machines_compute_the_same(march, tmp_path):
    # the kernel is compiled for the machine it runs on: its AVX2 and plain x86-64 paths
    # (what a machine without AVX-512, or without AVX2, gets) must be as exact as this one's
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 targets")
    if march == "haswell" and torch.cpu._is_avx2_supported() and not \
            torch.cpu._is_avx512_supported():  # as shared_prefix.py tells them apart
        pytest.skip("this machine's own build is the AVX2 path every other test here runs")
    env = {**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK, f"-march={march}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@needs_kernel
def test_indices_outside_their_tensors_are_errors():
    # every index the call names is checked before a row is read: a bad call raises, where
    # it read or wrote out of bounds before (an indptr past its indices killed the process)
    q, kb, vb, kvp, kvi = _paged_batch(4, [5, 7], 1, 4, 2, 16)
    rows, qptr = torch.arange(2), torch.arange(3)
    ok = cpu_paged.paged_attention(q, kb, vb, rows, qptr, kvp, kvi, 0.2)
    assert torch.isfinite(ok[0]).all()
    slots = kb.shape[0]
    bad = {
        "kv_indptr ends at": (rows, qptr, torch.tensor([0, 5, 12 + 100]), kvi),
        "past q_rows": (rows, torch.tensor([0, 1, 3]), kvp, kvi),
        "non-decreasing": (rows, qptr, torch.tensor([0, 8, 7]), kvi),
        "from 0 up": (rows, torch.tensor([-1, 1, 2]), kvp, kvi),
        "q_rows: rows of q": (torch.tensor([0, 2]), qptr, kvp, kvi),
        "kv_indices: slots of the pool": (rows, qptr, kvp,
                                          torch.cat([kvi[:-1], torch.tensor([slots])])),
        "slots of the pool": (rows, qptr, kvp, torch.cat([torch.tensor([-1]), kvi[1:]])),
    }
    for message, idx in bad.items():
        with pytest.raises(RuntimeError, match=message):
            cpu_paged.paged_attention(q, kb, vb, *idx, 0.2)
    # the same checks on the causal (extend) and initial-state forms
    o, lse = ok
    with pytest.raises(RuntimeError, match="kv_indptr ends at"):
        cpu_paged.paged_attention(q, kb, vb, rows, qptr, torch.tensor([0, 5, 13]), kvi, 0.2,
                                  causal=True, o_init=o, lse_init=lse)
