"""The AMX path of the CPU attention kernel (``csrc/amx_attention.cpp``): a bfloat16 q over
a bfloat16 pool, in tasks of at least 16 rows per KV head, against a float64 oracle over
the values the model holds (q, K, V already bf16). Its only rounding beyond the float32
path's is the probabilities' to bf16 before they weight V (as torch's bf16 attention
rounds them), so each output element is within 2^-8 of the largest |V| of its keys and
the log-sum-exp (float32 scores of exact bf16 products) within 1e-5. Every option of the
kernel (causal extend, windows, soft caps, an earlier pass's state, head widths 32-256,
GQA 1-8, pages of 1 and 16 slots, empty and key-less segments, tasks on both sides of the
16-row threshold in one call); outputs NaN-poisoned through ``o_init`` rows the call must
overwrite. Skipped where the CPU has no AMX-BF16."""

from __future__ import annotations

import math

import pytest
import torch

from radixlm import kernels
from radixlm.kernels import cpu_paged, reference
from radixlm.kernels.shared_prefix import AttentionPlan

needs_amx = pytest.mark.skipif(not cpu_paged.amx(), reason="no AMX-BF16 here")
BF16 = torch.bfloat16


def _oracle(q, kb, vb, rows, qi, ki, idx, scale, causal, window=0, cap=0.0, init=None):
    """float64 attention of each segment (row i of n at key position n_keys - n + i)."""
    n, hq, d = q.shape
    grp = hq // kb.shape[1]
    o = torch.zeros(n, hq, d, dtype=torch.float64)
    lse = torch.full((n, hq), -math.inf, dtype=torch.float64)
    if init is not None:
        o, lse = init[0].double().clone(), init[1].double().clone()
    for s in range(len(qi) - 1):
        r, sl = rows[qi[s]:qi[s + 1]], idx[ki[s]:ki[s + 1]]
        nr, nk = len(r), len(sl)
        if nr == 0:
            continue
        k = kb[sl].double().repeat_interleave(grp, 1)
        v = vb[sl].double().repeat_interleave(grp, 1)
        sc = torch.einsum("rhd,khd->hrk", q[r].double(), k) * scale
        if cap:
            sc = cap * torch.tanh(sc / cap)
        pos, key = torch.arange(nr) + nk - nr, torch.arange(nk)
        seen = torch.ones(nr, nk, dtype=torch.bool)
        if causal:
            seen &= key[None] <= pos[:, None]
        if window:
            seen &= key[None] > pos[:, None] - window
        sc = sc.masked_fill(~seen, -math.inf)
        if init is not None:  # the earlier pass as one more "key" of weight exp(lse0)
            sc = torch.cat((sc, lse[r].T[..., None]), dim=-1)
        l = torch.logsumexp(sc, -1)  # [h, r]
        p = torch.exp(sc - l[..., None]).nan_to_num(0.0)
        out = torch.einsum("hrk,khd->rhd", p[..., :nk], v)
        if init is not None:
            out = out + p[..., nk].T[..., None] * o[r]
        keep = torch.isfinite(l.T)
        o[r] = torch.where(keep[..., None], out, o[r])
        lse[r] = torch.where(keep, l.T, lse[r])
    return o, lse


def _segments(seed, shape, hq, hkv, d, page=1):
    """Segments of (rows, keys) over a pool of shuffled pages; rows numbered in order."""
    g = torch.Generator().manual_seed(seed)
    total = sum(k for _, k in shape)
    pages = (total + page - 1) // page + 2
    order = torch.randperm(pages, generator=g)
    slots = (order[:, None] * page + torch.arange(page)).reshape(-1)[:total]
    kb = (torch.randn(pages * page, hkv, d, generator=g) * 0.6).to(BF16)
    vb = torch.randn(pages * page, hkv, d, generator=g).to(BF16)
    n = sum(r for r, _ in shape)
    q = torch.randn(n, hq, d, generator=g).to(BF16)
    qi = torch.tensor([0] + [r for r, _ in shape]).cumsum(0)
    ki = torch.tensor([0] + [k for _, k in shape]).cumsum(0)
    return q, kb, vb, torch.arange(n), qi, ki, slots


def _check(o, lse, ro, rl, vmax):
    assert not torch.isnan(o).any(), "rows left unwritten"
    err = (o.double() - ro).abs().amax(dim=-1)  # [n, hq]
    assert bool((err <= 2**-8 * vmax).all()), f"max error {err.max().item():.2e}"
    finite = torch.isfinite(rl)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite].double(), rl[finite], rtol=1e-5, atol=1e-5)


# (rows, keys) per segment: AMX tasks (rows x group >= 16) beside FMA ones, a partial
# last tile of rows, a partial last block of keys, a segment with no rows (rows that see
# no key: test_amx_rows_that_see_no_key_keep_their_state)
SHAPE = [(37, 150), (5, 5), (64, 300), (1, 100), (0, 7), (20, 20), (130, 130)]


@needs_amx
@pytest.mark.parametrize("heads", [(12, 4), (8, 1), (4, 4), (16, 2)])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_amx_matches_f64(heads, d, causal):
    hq, hkv = heads
    q, kb, vb, rows, qi, ki, idx = _segments(hq * d + causal, SHAPE, hq, hkv, d)
    o, lse = cpu_paged.paged_attention(q, kb, vb, rows, qi, ki, idx, d**-0.5, causal)
    ro, rl = _oracle(q, kb, vb, rows, qi, ki, idx, d**-0.5, causal)
    _check(o, lse, ro, rl, vb.abs().max().item())
    # the tile tasks really ran: their probabilities were rounded to bf16 (differences of
    # about 5e-4 from a float32 q's FMA path), while segments below the tiles' least rows per
    # head or keys took the FMA path (the same products, bf16 scores summed in another
    # order: about 1e-7)
    o32, _ = cpu_paged.paged_attention(q.float(), kb, vb, rows, qi, ki, idx, d**-0.5, causal)
    min_rows = torch.ops.radixlm_cpu.bf16_tiles_min_rows()
    min_keys = torch.ops.radixlm_cpu.bf16_tiles_min_keys()
    for seg in (1, 2, 5):  # (5, 5), (64, 300), (20, 20): not cut into pieces
        n, keys = SHAPE[seg]
        part = slice(int(qi[seg]), int(qi[seg + 1]))
        diff = (o[part] - o32[part]).abs().max().item()
        if n * (hq // hkv) >= min_rows and keys >= min_keys:
            assert diff > 1e-4, (seg, diff)
        else:
            assert diff < 1e-5, (seg, diff)


@needs_amx
@pytest.mark.parametrize("window,cap", [(40, 0.0), (0, 30.0), (100, 20.0), (1, 0.0)])
def test_amx_windows_and_caps(window, cap):
    q, kb, vb, rows, qi, ki, idx = _segments(window + int(cap), SHAPE, 12, 4, 64, page=16)
    o, lse = cpu_paged.paged_attention(q, kb, vb, rows, qi, ki, idx, 0.125, True,
                                       sliding_window=window or None, logit_cap=cap or None)
    ro, rl = _oracle(q, kb, vb, rows, qi, ki, idx, 0.125, True, window, cap)
    _check(o, lse, ro, rl, vb.abs().max().item())


@needs_amx
def test_amx_continues_an_earlier_pass():
    """o_init / lse_init: the softmax goes on from an earlier pass's state; rows of no
    segment keep it (NaN-poisoned rows in a segment must be overwritten, so none here)."""
    q, kb, vb, rows, qi, ki, idx = _segments(3, [(40, 90), (30, 64)], 12, 4, 64)
    g = torch.Generator().manual_seed(4)
    o0 = torch.randn(q.shape, generator=g)
    l0 = torch.randn(q.shape[:2], generator=g) * 3
    l0[5, :3] = -math.inf  # rows with nothing before
    o0[5, :3] = 0.0
    o, lse = cpu_paged.paged_attention(q, kb, vb, rows, qi, ki, idx, 0.125, False, o0, l0)
    ro, rl = _oracle(q, kb, vb, rows, qi, ki, idx, 0.125, False, init=(o0, l0))
    _check(o, lse, ro, rl, max(vb.abs().max().item(), o0.abs().max().item()))


@needs_amx
def test_amx_rows_that_see_no_key_keep_their_state():
    """Rows of a segment with no keys: 0 / -inf, or o_init / lse_init where given (the
    NaN-poisoned initial rows must come back untouched, the other segment's written)."""
    q, kb, vb, rows, qi, ki, idx = _segments(5, [(24, 0), (24, 48)], 12, 4, 64)
    poison = torch.full(q.shape, float("nan"))
    o, lse = cpu_paged.paged_attention(q, kb, vb, rows, qi, ki, idx, 0.125, False)
    assert (o[:24] == 0).all() and (lse[:24] == -math.inf).all()
    o2, lse2 = cpu_paged.paged_attention(q, kb, vb, rows, qi, ki, idx, 0.125, False,
                                         poison, torch.full(q.shape[:2], -math.inf))
    assert torch.isnan(o2[:24]).all() and not torch.isnan(o2[24:]).any()
    torch.testing.assert_close(o2[24:], o[24:], rtol=0, atol=0)


@needs_amx
def test_plan_sends_every_bf16_extend_row_to_the_kernel():
    """With ``amx`` the plan has no padded passes, whatever the chunks' lengths and the
    groups' rows, and the result is the oracle's."""
    lens, prefix = [300, 3, 40, 1], [64, 64, 0, 64]
    q, kb, vb, rows, _, _, _ = _segments(9, [(sum(lens), sum(lens) + 200)], 12, 4, 64)
    g = torch.Generator().manual_seed(10)
    slots = torch.randperm(kb.shape[0] - 1, generator=g)[: sum(lens) + 64]
    shared, new = slots[:64], slots[64:]
    kvi = torch.cat([shared if p else shared[:0] for p in prefix])
    kvp = torch.tensor([0] + prefix).cumsum(0)
    qo = torch.tensor([0] + lens).cumsum(0)
    groups = [(64, [0, 1, 3])]
    for use_groups in (False, True):
        plan = AttentionPlan.build(qo, kvp, kvi, 4 * 64, extend=True, paged_kernel=True,
                                   new_slots=new, dtype=BF16, amx=True,
                                   prefix_groups=groups if use_groups else None)
        assert plan.amx and plan.paged is not None and not plan.padded and plan.shared is None
        out = torch.full_like(q, float("nan"))
        kernels.extend_attention(q, kb[new], vb[new], kb, vb, qo, kvp, kvi, 0.125,
                                 backend="torch", out=out, plan=plan)
        ref = reference.extend_attention(q.double(), kb[new].double(), vb[new].double(),
                                         kb.double(), vb.double(), qo, kvp, kvi, 0.125)
        assert not torch.isnan(out).any()
        err = (out.double() - ref).abs().max().item()
        # the kernel's 2^-8 |V| plus the output's rounding to bf16
        assert err <= 2**-8 * vb.abs().max().item() + 2**-8 * ref.abs().max().item(), err
