"""Sliding windows and soft-capped scores in the compiled CPU kernel (``cpu_paged``), through
the plan and the ``kernels`` dispatch as the model calls them, against a float64 oracle:
row at position p sees keys p - W < j <= p (transformers' sliding-window mask), scores
capped to ``cap * tanh(s / cap)``. Outputs start as NaN (a skipped row cannot pass); the
masked torch path is made to refuse, so a case that silently fell back to it fails; the
window boundary is pinned by the oracle with W - 1 and W + 1, which differ from it."""

from __future__ import annotations

import pytest
import torch

from radixlm import kernels
from radixlm.kernels import cpu_paged, masked_attention, shared_prefix
from radixlm.kernels.shared_prefix import AttentionPlan

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="kernel not built")
SCALE = 0.35


def oracle(q, k_buf, v_buf, q_lens, seq_slots, window, cap) -> torch.Tensor:
    """float64; sequence b's keys are ``seq_slots[b]`` (its positions 0, 1, ...), its
    ``q_lens[b]`` rows the last of them."""
    grp = q.shape[1] // k_buf.shape[1]
    outs, row = [], 0
    for n, slots in zip(q_lens, seq_slots):
        keys = k_buf[slots].double().repeat_interleave(grp, 1)
        vals = v_buf[slots].double().repeat_interleave(grp, 1)
        s = torch.einsum("nhd,lhd->hnl", q[row: row + n].double(), keys) * SCALE
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        p = torch.arange(n)[:, None] + len(slots) - n
        j = torch.arange(len(slots))[None, :]
        seen = (j <= p) & ((p - j < window) if window is not None else True)
        outs.append(torch.einsum("hnl,lhd->nhd", s.masked_fill(~seen, float("-inf"))
                                 .softmax(-1), vals))
        row += n
    return torch.cat(outs)


def _pool(seed, prefix_lens, q_lens, hq, hkv, d, dtype):
    """Shuffled slots; each sequence's prefix then its new tokens (stored in the pool)."""
    g = torch.Generator().manual_seed(seed)
    total = [p + n for p, n in zip(prefix_lens, q_lens)]
    order = torch.randperm(sum(total) + 7, generator=g)
    seq_slots = list(order[: sum(total)].split(total))
    k_buf = (torch.randn(len(order), hkv, d, generator=g) * 1.5).to(dtype)
    v_buf = torch.randn(len(order), hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g) * 1.5
    return q, k_buf, v_buf, seq_slots


def _refuse_masked(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("took the masked torch path")

    monkeypatch.setattr(masked_attention, "extend_attention", refuse)
    monkeypatch.setattr(masked_attention, "decode_attention", refuse)


def _extend(q, k_buf, v_buf, prefix_lens, q_lens, seq_slots, window, cap, groups=None):
    kvi = torch.cat([s[:p] for s, p in zip(seq_slots, prefix_lens)])
    new_slots = torch.cat([s[p:] for s, p in zip(seq_slots, prefix_lens)])
    qo = torch.tensor([0] + q_lens).cumsum(0)
    kvp = torch.tensor([0] + prefix_lens).cumsum(0)
    plan = AttentionPlan.build(qo, kvp, kvi, k_buf.shape[1] * k_buf.shape[2], extend=True,
                               prefix_groups=groups, paged_kernel=True, new_slots=new_slots)
    out = torch.full_like(q, float("nan"))
    kernels.extend_attention(q, k_buf[new_slots].float(), v_buf[new_slots].float(), k_buf,
                             v_buf, qo, kvp, kvi, SCALE, out=out, plan=plan,
                             sliding_window=window, logit_cap=cap)
    assert not torch.isnan(out).any(), "rows left unwritten"
    return out, plan


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("d", [64, 40])  # the vector path and the scalar one
@pytest.mark.parametrize("window", [1, 7, 64, 100, 300])  # < , = (100), > the sequences
@pytest.mark.parametrize("cap", [None, 2.0])
def test_extend_matches_f64(dtype, heads, d, window, cap, monkeypatch):
    # sequence 0 extends 30 rows over a 150-token prefix (longer than most windows),
    # 1 is a 100-token prompt (window 100 = its length), 2 one row over 199 cached
    _refuse_masked(monkeypatch)
    prefix_lens, q_lens = [150, 0, 199], [30, 100, 1]
    q, kb, vb, seqs = _pool(window + d, prefix_lens, q_lens, *heads, d, dtype)
    out, _ = _extend(q, kb, vb, prefix_lens, q_lens, seqs, window, cap)
    assert _rel(out, oracle(q, kb, vb, q_lens, seqs, window, cap)) < 2e-5


@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("window", [3, 64, 65])  # 64, 65: the edge on a key block's
def test_window_boundary_is_exact(d, window, monkeypatch):
    """W - 1 or W + 1 keys per row would change the result far beyond the tolerance."""
    _refuse_masked(monkeypatch)
    prefix_lens, q_lens = [90, 0], [70, 140]
    q, kb, vb, seqs = _pool(d, prefix_lens, q_lens, 4, 2, d, torch.float32)
    out, _ = _extend(q, kb, vb, prefix_lens, q_lens, seqs, window, None)
    assert _rel(out, oracle(q, kb, vb, q_lens, seqs, window, None)) < 1e-5
    for off_by_one in (window - 1, window + 1):
        assert _rel(out, oracle(q, kb, vb, q_lens, seqs, off_by_one, None)) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 16, 64, 1000])
@pytest.mark.parametrize("cap", [None, 0.5, 50.0])
def test_decode_matches_f64(dtype, window, cap, monkeypatch):
    if window is None and cap is None:
        pytest.skip("neither option: the plain kernel (test_cpu_paged)")
    _refuse_masked(monkeypatch)
    lens = [1, 16, 17, 64, 65, 300]
    q, kb, vb, seqs = _pool(7, [n - 1 for n in lens], [1] * len(lens), 8, 2, 64, dtype)
    kvi, kvp = torch.cat(seqs), torch.tensor([0] + lens).cumsum(0)
    plan = AttentionPlan.build(torch.arange(len(lens) + 1), kvp, kvi, 128, extend=False,
                               paged_kernel=True)
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, kb, vb, kvp, kvi, SCALE, out=out, plan=plan,
                             sliding_window=window, logit_cap=cap)
    ref = oracle(q, kb, vb, [1] * len(lens), seqs, window, cap)
    assert _rel(out, ref) < 2e-5
    if cap is not None and window != 1:  # the cap bites (one key: no softmax to change)
        assert _rel(out, oracle(q, kb, vb, [1] * len(lens), seqs, window, None)) > 1e-3


def test_groups_keep_the_cap_and_leave_windows_to_flat_segments(monkeypatch):
    """With shared-prefix groups a capped layer runs the groups' passes (cap in both), a
    windowed one the group-free segments (a group's rows stand at their own positions)."""
    from radixlm.kernels import shared_prefix

    _refuse_masked(monkeypatch)
    monkeypatch.setattr(shared_prefix, "KERNEL_GROUP_KEYS_PER_ROW", 0)  # 30 keys, 7 rows
    prefix_lens, q_lens = [40, 40, 12], [5, 9, 3]
    q, kb, vb, seqs = _pool(11, prefix_lens, q_lens, 4, 2, 32, torch.float32)
    seqs[1][:30] = seqs[0][:30]  # sequences 0 and 1 share their first 30 slots
    groups = [(30, [0, 1])]
    for window, cap in ((None, 1.5), (20, None), (20, 1.5)):
        out, plan = _extend(q, kb, vb, prefix_lens, q_lens, seqs, window, cap, groups)
        assert plan.paged[1] is not None and plan.flat is not plan.paged[0]
        passes = plan.masked_passes(window)
        assert (passes is plan.paged) == (window is None) and (passes[1] is None) != (
            window is None)
        assert _rel(out, oracle(q, kb, vb, q_lens, seqs, window, cap)) < 1e-5


@pytest.mark.parametrize("window, cap", [(16, None), (None, 3.0)])
def test_rows_past_the_extend_threshold_stay_on_the_kernel(window, cap, monkeypatch):
    """A sequence over the plan's extend-row limit puts plain layers on the padded passes;
    windowed / capped layers still take the kernel (flat segments), not masked_attention."""
    _refuse_masked(monkeypatch)
    monkeypatch.setattr(shared_prefix, "KERNEL_MAX_EXTEND_ROWS", 32)
    prefix_lens, q_lens = [20, 0, 5], [40, 10, 70]
    q, kb, vb, seqs = _pool(5, prefix_lens, q_lens, 4, 2, 32, torch.float32)
    out, plan = _extend(q, kb, vb, prefix_lens, q_lens, seqs, window, cap)
    assert plan.padded and plan.masked_passes(window) == (plan.flat, None)
    assert len(plan.flat.q_indptr) == 4 and plan.flat is not plan.paged[0]
    assert _rel(out, oracle(q, kb, vb, q_lens, seqs, window, cap)) < 1e-5


def test_without_the_kernel_or_a_plan_the_masked_path(monkeypatch):
    calls = []
    real = masked_attention.decode_attention
    monkeypatch.setattr(masked_attention, "decode_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    q, kb, vb, seqs = _pool(2, [29, 9], [1, 1], 4, 2, 32, torch.float32)
    kvi, kvp = torch.cat(seqs), torch.tensor([0, 30, 40])
    ref = oracle(q, kb, vb, [1, 1], seqs, 8, 2.0)
    plain = AttentionPlan.build(torch.arange(3), kvp, kvi, 64, extend=False)
    for plan in (plain, None):
        out = kernels.decode_attention(q, kb, vb, kvp, kvi, SCALE, plan=plan,
                                       sliding_window=8, logit_cap=2.0)
        assert _rel(out, ref) < 1e-5
    assert plain.flat is None and calls == [1, 1]
    qo, kvp0 = torch.arange(3), torch.zeros(3, dtype=torch.long)  # extend without new_slots
    no_slots = AttentionPlan.build(qo, kvp0, kvi[:0], 64, extend=True, paged_kernel=True)
    assert no_slots.masked_passes(8) is None


@pytest.mark.parametrize("causal", [True, False])
def test_a_segment_starting_mid_sequence_sees_the_same_window(causal):
    """Only differences of positions count: keys from some position s > 0 on (a window
    view's, a window-sized pool's) give the window over the whole sequence, as long as
    every row's window starts at or after s."""
    n, total, window, start = (20, 150, 30, 90) if causal else (1, 150, 30, 120)
    q, kb, vb, seqs = _pool(9, [total - n], [n], 4, 2, 64, torch.float32)
    keys = seqs[0][start:]
    o, _ = cpu_paged.paged_attention(q, kb, vb, torch.arange(n), torch.tensor([0, n]),
                                     torch.tensor([0, len(keys)]), keys, SCALE, causal,
                                     sliding_window=window, logit_cap=4.0)
    assert _rel(o, oracle(q, kb, vb, [n], seqs, window, 4.0)) < 1e-5
