"""Attention with sliding windows and soft-capped scores against a float64 oracle that
loops over every (query, key) pair: the torch path (``kernels.masked_attention``) and the
Triton kernels (interpreted without CUDA); outputs start as NaN so a row a kernel skips
cannot pass."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # before the Triton kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm import kernels  # noqa: E402
from radixlm.kernels import masked_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(q_lens, kv_lens, hq, hkv, d, seed, extend, dtype=torch.float32):
    """Paged slots in a shuffled order; decode: kv_lens include the new token."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(kv_lens) + 5
    order = torch.randperm(total, generator=gen)
    kv_indices = order[: sum(kv_lens)]
    n = sum(q_lens)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * 2).to(dtype)

    return dict(q=randn(n, hq, d), k=randn(n, hkv, d) if extend else None,
                v=randn(n, hkv, d) if extend else None, k_buf=randn(total, hkv, d),
                v_buf=randn(total, hkv, d),
                qo_indptr=torch.tensor([0] + q_lens).cumsum(0),
                kv_indptr=torch.tensor([0] + kv_lens).cumsum(0), kv_indices=kv_indices)


def _on(b: dict, backend: str | None) -> dict:
    """The batch on the Triton path's device (CUDA when there is one)."""
    dev = DEVICE if backend == "triton" else "cpu"
    return {k: None if v is None else v.to(dev) for k, v in b.items()}


def oracle(b, sm_scale, window, cap) -> torch.Tensor:
    """Query at position p sees key j iff j <= p and p - j < window; float64 loops."""
    q, out = b["q"].double(), torch.zeros(b["q"].shape, dtype=torch.float64)
    group = q.shape[1] // b["k_buf"].shape[1]
    qo, kv = b["qo_indptr"].tolist(), b["kv_indptr"].tolist()
    for s in range(len(qo) - 1):
        idx = b["kv_indices"][kv[s]: kv[s + 1]]
        keys, values = b["k_buf"][idx].double(), b["v_buf"][idx].double()
        if b["k"] is not None:
            keys = torch.cat((keys, b["k"][qo[s]: qo[s + 1]].double()))
            values = torch.cat((values, b["v"][qo[s]: qo[s + 1]].double()))
        n, length = qo[s + 1] - qo[s], keys.shape[0]
        for i in range(n):
            p = length - n + i
            for h in range(q.shape[1]):
                seen = [j for j in range(p + 1) if window is None or p - j < window]
                scores = [float(q[qo[s] + i, h] @ keys[j, h // group]) * sm_scale for j in seen]
                if cap is not None:
                    scores = [cap * math.tanh(x / cap) for x in scores]
                w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[qo[s] + i, h] = (w[:, None] * values[seen, h // group]).sum(0)
    return out


CASES = [(None, None), (5, None), (None, 3.0), (4, 2.0), (1, None)]


# the plain case (no window, no cap) is the planned torch path's; the plain Triton kernels
# are checked (interpreted) in test_attention_kernels.py
@pytest.mark.parametrize("window,cap,backend",
                         [(w, c, b) for w, c in CASES for b in (None, "torch", "triton")
                          if not (w is None and c is None and b == "triton")])
def test_extend_matches_float64(window, cap, backend):
    b = _batch([3, 7, 1], [0, 9, 4], hq=4, hkv=2, d=8, seed=1, extend=True)
    x = _on(b, backend)
    out = torch.full_like(x["q"], float("nan"))
    kernels.extend_attention(x["q"], x["k"], x["v"], x["k_buf"], x["v_buf"], x["qo_indptr"],
                             x["kv_indptr"], x["kv_indices"], 0.3, backend=backend, out=out,
                             sliding_window=window, logit_cap=cap)
    torch.testing.assert_close(out.double().cpu(), oracle(b, 0.3, window, cap), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("window,cap", [(20, None), (20, 2.5), (7, None), (None, 2.5)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_windows_across_key_blocks(window, cap, backend):
    """Prefixes and chunks longer than the kernels' key blocks (32 rows interpreted, 64 on
    a GPU), windows starting mid-block, a sequence with no prefix."""
    b = _batch([45, 3, 70], [50, 90, 0], hq=4, hkv=2, d=16, seed=5, extend=True)
    x = _on(b, backend)
    out = torch.full_like(x["q"], float("nan"))
    kernels.extend_attention(x["q"], x["k"], x["v"], x["k_buf"], x["v_buf"], x["qo_indptr"],
                             x["kv_indptr"], x["kv_indices"], 0.25, backend=backend, out=out,
                             sliding_window=window, logit_cap=cap)
    torch.testing.assert_close(out.double().cpu(), oracle(b, 0.25, window, cap), atol=1e-5,
                               rtol=0)
    d = _batch([1, 1, 1], [1, 130, 70], hq=4, hkv=2, d=16, seed=6, extend=False)
    y = _on(d, backend)
    out = torch.full_like(y["q"], float("nan"))
    kernels.decode_attention(y["q"], y["k_buf"], y["v_buf"], y["kv_indptr"], y["kv_indices"],
                             0.25, backend=backend, out=out, sliding_window=window,
                             logit_cap=cap)
    torch.testing.assert_close(out.double().cpu(), oracle(d, 0.25, window, cap), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("window,cap", CASES[1:])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_matches_float64(window, cap, backend):
    b = _batch([1, 1, 1], [1, 12, 6], hq=4, hkv=1, d=8, seed=2, extend=False)
    x = _on(b, backend)
    out = torch.full_like(x["q"], float("nan"))
    kernels.decode_attention(x["q"], x["k_buf"], x["v_buf"], x["kv_indptr"], x["kv_indices"],
                             0.3, backend=backend, out=out, sliding_window=window,
                             logit_cap=cap)
    torch.testing.assert_close(out.double().cpu(), oracle(b, 0.3, window, cap), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("cap", [2.0, None])
def test_bfloat16_pool_within_tolerance(cap):
    b = _batch([4, 2], [6, 0], hq=2, hkv=1, d=8, seed=3, extend=True, dtype=torch.bfloat16)
    out = kernels.extend_attention(b["q"], b["k"], b["v"], b["k_buf"], b["v_buf"],
                                   b["qo_indptr"], b["kv_indptr"], b["kv_indices"], 0.3,
                                   sliding_window=3, logit_cap=cap)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle(b, 0.3, 3, cap), atol=3e-2, rtol=0)


@pytest.mark.parametrize("window,cap,field", [(0, None, "sliding_window"),
                                               (True, None, "sliding_window"),
                                               (None, 0.0, "logit_cap"),
                                               (None, -1.0, "logit_cap")])
def test_bad_options_are_clear(window, cap, field):
    b = _batch([1], [2], hq=1, hkv=1, d=4, seed=0, extend=False)
    with pytest.raises(ValueError, match=field):
        kernels.decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                 b["kv_indices"], 0.5, sliding_window=window, logit_cap=cap)


def test_query_blocks_cover_every_row(monkeypatch):
    """Blocks of 3 query rows: each block's key span starts at its own window."""
    monkeypatch.setattr(masked_attention, "QUERY_BLOCK", 3)
    for window, cap in CASES:
        b = _batch([8, 5], [4, 11], hq=4, hkv=2, d=8, seed=4, extend=True)
        out = torch.full_like(b["q"], float("nan"))
        kernels.extend_attention(b["q"], b["k"], b["v"], b["k_buf"], b["v_buf"],
                                 b["qo_indptr"], b["kv_indptr"], b["kv_indices"], 0.3, out=out,
                                 sliding_window=window or 4, logit_cap=cap)
        torch.testing.assert_close(out.double(), oracle(b, 0.3, window or 4, cap), atol=1e-5,
                                   rtol=0)
