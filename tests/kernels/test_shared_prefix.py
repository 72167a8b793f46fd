"""Planned torch attention (one plan per forward, shared prefixes read once per group)
against a float64 dense attention, on random ragged batches whose sequences share
prefixes of the pool, decode and extend, with NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from radixlm import kernels
from radixlm.kernels.shared_prefix import AttentionPlan


def _batch(seed: int, extend: bool, hq: int, hkv: int, d: int):
    """Sequences 0-2 share prefix A (L=40), 3-4 share prefix B (L=17), 5 shares none."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(600, generator=g)
    shared_a, shared_b, own = slots[:40], slots[40:57], slots[57:]
    own_lens = [5, 0, 23, 9, 1, 30] if extend else [5, 1, 23, 9, 1, 30]
    groups = [(40, [0, 1, 2]), (17, [3, 4])]
    seqs, off = [], 0
    for b, n in enumerate(own_lens):
        head = shared_a if b < 3 else shared_b if b < 5 else own[:0]
        seqs.append(torch.cat([head, own[off: off + n]]))
        off += n
    kv_indices = torch.cat(seqs)
    kv_indptr = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    q_lens = [3, 1, 4, 2, 6, 1] if extend else [1] * 6
    qo_indptr = torch.tensor([0] + q_lens).cumsum(0)
    n = int(qo_indptr[-1])

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    q = randn(n, hq, d)
    k, v = (randn(n, hkv, d), randn(n, hkv, d)) if extend else (None, None)
    return q, k, v, randn(600, hkv, d), randn(600, hkv, d), qo_indptr, kv_indptr, kv_indices, groups


def _dense_f64(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale):
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    group = q.shape[1] // k_buf.shape[1]
    outs = []
    for s in range(len(qo) - 1):
        idx = kv_indices[kv[s]: kv[s + 1]]
        keys, vals = k_buf[idx].double(), v_buf[idx].double()
        if k is not None:
            keys = torch.cat((keys, k[qo[s]: qo[s + 1]].double()))
            vals = torch.cat((vals, v[qo[s]: qo[s + 1]].double()))
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        qq = q[qo[s]: qo[s + 1]].double()
        scores = torch.einsum("nhd,lhd->hnl", qq, keys) * scale
        n, length = qq.shape[0], keys.shape[0]
        visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vals))
    return torch.cat(outs)


@pytest.mark.parametrize("extend", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("use_groups", [False, True])
def test_planned_attention_matches_f64(extend, heads, use_groups):
    hq, hkv = heads
    for seed in range(3):
        q, k, v, kb, vb, qo, kvp, kvi, groups = _batch(seed, extend, hq, hkv, 32)
        plan = AttentionPlan.build(qo, kvp, kvi, hkv * 32, extend=extend,
                                   prefix_groups=groups if use_groups else None)
        out = torch.full_like(q, float("nan"))
        if extend:
            kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.17, backend="torch",
                                     out=out, plan=plan)
        else:
            kernels.decode_attention(q, kb, vb, kvp, kvi, 0.17, backend="torch", out=out,
                                     plan=plan)
        assert not torch.isnan(out).any(), "rows left unwritten"
        ref = _dense_f64(q, k, v, kb, vb, qo, kvp, kvi, 0.17)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, err


@pytest.mark.parametrize("extend", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("use_groups", [False, True])
def test_planned_attention_over_a_narrow_pool_matches_f64(extend, kv_dtype, use_groups):
    """--kv-cache-dtype: a pool narrower than q. The padded passes convert the rows they
    gather; the oracle is float64 attention over the same rounded K/V (the new tokens of an
    extend rounded too, as store_kv puts them in the pool)."""
    q, k, v, kb, vb, qo, kvp, kvi, groups = _batch(5, extend, 4, 2, 32)
    kb, vb = kb.to(kv_dtype), vb.to(kv_dtype)
    plan = AttentionPlan.build(qo, kvp, kvi, 64, extend=extend,
                               prefix_groups=groups if use_groups else None)
    out = torch.full_like(q, float("nan"))
    if extend:
        kernels.extend_attention(q, k, v, kb, vb, qo, kvp, kvi, 0.17, backend="torch", out=out,
                                 plan=plan)
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    else:
        kernels.decode_attention(q, kb, vb, kvp, kvi, 0.17, backend="torch", out=out, plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = _dense_f64(q, k, v, kb, vb, qo, kvp, kvi, 0.17)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_groups_that_do_not_share_are_rejected():
    q, k, v, kb, vb, qo, kvp, kvi, _ = _batch(0, False, 4, 2, 32)
    with pytest.raises(ValueError, match="share"):
        AttentionPlan.build(qo, kvp, kvi, 64, extend=False, prefix_groups=[(17, [0, 3])])
    with pytest.raises(ValueError, match="fewer"):
        AttentionPlan.build(qo, kvp, kvi, 64, extend=False, prefix_groups=[(40, [0, 5])])
    with pytest.raises(ValueError, match="two groups"):
        AttentionPlan.build(qo, kvp, kvi, 64, extend=False,
                            prefix_groups=[(40, [0, 1]), (17, [1, 3])])
    groups = [(40, [0, 1, 2]), (17, [3, 4]), (5, [5])]  # a lone member has nothing to match
    AttentionPlan.build(qo, kvp, kvi, 64, extend=False, prefix_groups=groups)
    for seq, length in ((4, 17), (2, 40)):  # only the last slot of its prefix differs
        bad = kvi.clone()
        bad[int(kvp[seq]) + length - 1] += 1
        with pytest.raises(ValueError, match=f"sequence {seq} does not share its first "
                                             f"{length} KV slots"):
            AttentionPlan.build(qo, kvp, bad, 64, extend=False, prefix_groups=groups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_prompts_take_causal_passes_of_their_own_length(dtype):
    """Prompts with nothing cached go through torch's causal attention in passes of one
    length (no padding, no mask: is_causal skips the blocks past the diagonal); prompts
    with a cached prefix keep the masked passes. Both against float64."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = 6, 2, 32
    q_lens = [7, 3, 7, 12, 1, 5]
    cached = [0, 0, 0, 0, 0, 9]  # the last one continues a prompt (a chunk, a cache hit)
    slots = torch.randperm(200, generator=g)
    kv_indices = slots[: sum(cached)]
    kv_indptr = torch.tensor([0, *cached]).cumsum(0)
    qo_indptr = torch.tensor([0, *q_lens]).cumsum(0)
    n = sum(q_lens)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(n, hkv, d, generator=g).to(dtype) for _ in range(2))
    kb, vb = (torch.randn(200, hkv, d, generator=g).to(dtype) for _ in range(2))
    plan = AttentionPlan.build(qo_indptr, kv_indptr, kv_indices, hkv * d, extend=True,
                               dtype=dtype)
    causal = [p for p in plan.padded if p.slots.shape[1] == 0
              and p.valid.numel() == p.q_rows.numel()]
    assert sorted(p.q_rows.shape for p in causal) == [(1, 1), (1, 3), (1, 12), (2, 7)]
    assert len(plan.padded) == len(causal) + 1  # the continued prompt: a masked pass
    out = torch.full_like(q, float("nan"))
    kernels.extend_attention(q, k, v, kb, vb, qo_indptr, kv_indptr, kv_indices, 0.2,
                             backend="torch", out=out, plan=plan)
    assert not torch.isnan(out).any(), "rows left unwritten"
    ref = _dense_f64(q.float(), k.float(), v.float(), kb.float(), vb.float(), qo_indptr,
                     kv_indptr, kv_indices, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
