"""Attention sinks (gpt-oss: a learned logit per query head in the softmax, with no value)
on every attention path against a float64 oracle that appends the sink to each row's
scores: the masked torch path (with a window), the plain path without a plan, the planned
passes (with shared-prefix groups), the compiled CPU kernel (its log-sum-exp), and the
Triton decode / extend kernels (interpreted without CUDA). Outputs start as NaN, so a row a
path skips cannot pass; the oracle without sinks differs, so a path that drops them fails."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the Triton kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm import kernels  # noqa: E402
from radixlm.kernels import cpu_paged  # noqa: E402
from radixlm.kernels.shared_prefix import AttentionPlan  # noqa: E402

HQ, HKV, D, SCALE = 4, 2, 16, 0.3
SINKS = torch.tensor([0.5, -1.0, 2.5, 1.5])
SHARED = 20  # sequences 0-2 share their first 20 slots


def _batch(seed: int, extend: bool) -> dict:
    """Four sequences, the first three sharing a prefix; in extend the new tokens' K/V are
    also in the pool at ``new_slots`` (where store_kv puts them before attention)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(400, generator=g)
    own = [3, 0, 11, 30] if extend else [3, 1, 11, 30]
    q_lens = [2, 5, 1, 40] if extend else [1, 1, 1, 1]
    seqs, off = [], SHARED
    for b, n in enumerate(own):
        head = slots[:SHARED] if b < 3 else slots[:0]
        seqs.append(torch.cat((head, slots[off: off + n])))
        off += n
    new_slots = slots[off: off + sum(q_lens)] if extend else None
    k_buf, v_buf = (torch.randn(400, HKV, D, generator=g) * 1.5 for _ in range(2))
    return dict(q=torch.randn(sum(q_lens), HQ, D, generator=g) * 1.5,
                k=k_buf[new_slots] if extend else None, v=v_buf[new_slots] if extend else None,
                k_buf=k_buf, v_buf=v_buf, qo_indptr=torch.tensor([0] + q_lens).cumsum(0),
                kv_indptr=torch.tensor([0] + [len(s) for s in seqs]).cumsum(0),
                kv_indices=torch.cat(seqs), new_slots=new_slots,
                groups=[(SHARED, [0, 1, 2])])


def oracle(b: dict, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """float64: query at p sees key j iff j <= p and p - j < window; the sink is one more
    score per head whose probability multiplies nothing."""
    group = HQ // HKV
    qo, kv = b["qo_indptr"].tolist(), b["kv_indptr"].tolist()
    outs = []
    for s in range(len(qo) - 1):
        idx = b["kv_indices"][kv[s]: kv[s + 1]]
        keys, vals = b["k_buf"][idx].double(), b["v_buf"][idx].double()
        if b["k"] is not None:
            keys = torch.cat((keys, b["k"][qo[s]: qo[s + 1]].double()))
            vals = torch.cat((vals, b["v"][qo[s]: qo[s + 1]].double()))
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        q = b["q"][qo[s]: qo[s + 1]].double()
        n, length = q.shape[0], keys.shape[0]
        scores = torch.einsum("nhd,lhd->hnl", q, keys) * SCALE  # [H, n, L]
        q_pos = torch.arange(n)[:, None] + (length - n)
        k_pos = torch.arange(length)[None, :]
        seen = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, n, 1)
            probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vals))
    return torch.cat(outs)


def _run(b: dict, extend: bool, dev: str = "cpu", **options) -> torch.Tensor:
    x = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
    out = torch.full_like(x["q"], float("nan"))
    sinks = SINKS.to(dev)
    if extend:
        kernels.extend_attention(x["q"], x["k"], x["v"], x["k_buf"], x["v_buf"],
                                 x["qo_indptr"], x["kv_indptr"], x["kv_indices"], SCALE,
                                 out=out, sinks=sinks, **options)
    else:
        kernels.decode_attention(x["q"], x["k_buf"], x["v_buf"], x["kv_indptr"],
                                 x["kv_indices"], SCALE, out=out, sinks=sinks, **options)
    assert not torch.isnan(out).any(), "rows left unwritten"
    return out.double().cpu()


def _check(got: torch.Tensor, b: dict, window: int | None) -> None:
    want = oracle(b, window, SINKS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the sinks matter at these sizes: a path that ignored them could not pass
    assert (oracle(b, window, None) - want).abs().max() > 1e-2


PLANS = ["none", "planned", "planned_groups", "paged", "paged_groups"]


@pytest.mark.parametrize("extend", [False, True])
@pytest.mark.parametrize("plan", PLANS)
def test_torch_paths_match_float64(extend, plan):
    """No plan: masked_attention; a plan: its passes' log-sum-exp, ``o * sigmoid(lse - s)``
    (paged: the compiled CPU kernel's lse, groups merged first)."""
    if plan.startswith("paged") and not cpu_paged.available():
        pytest.skip("the CPU paged kernel is not built on this machine")
    b = _batch(1, extend)
    built = None
    if plan != "none":
        built = AttentionPlan.build(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], HKV * D,
                                    extend=extend, paged_kernel=plan.startswith("paged"),
                                    prefix_groups=b["groups"] if "groups" in plan else None,
                                    new_slots=b["new_slots"])
        if plan.startswith("paged"):
            assert built.paged is not None, "the plan was meant to take the CPU kernel"
    _check(_run(b, extend, backend="torch", plan=built), b, None)


@pytest.mark.parametrize("extend", [False, True])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_kernels_match_float64(extend, window):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b = _batch(2, extend)
    _check(_run(b, extend, dev, backend="triton", sliding_window=window), b, window)


@pytest.mark.parametrize("extend", [False, True])
def test_masked_path_with_a_window_matches_float64(extend):
    b = _batch(3, extend)
    _check(_run(b, extend, backend="torch", sliding_window=7), b, 7)


def test_bad_sinks_are_clear():
    b = _batch(0, False)
    with pytest.raises(ValueError, match="sinks"):
        kernels.decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                 b["kv_indices"], SCALE, sinks=torch.zeros(HQ + 1))
