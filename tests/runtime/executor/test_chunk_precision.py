"""The float32 chunked scans (the gated delta rule; Mamba2's SSD) are as exact as their
float32 token-by-token steps: both against the steps in float64 (the step functions compute
in float64 when given float64; test_gated_delta.py and test_mamba2.py check them against
transformers'), with decays strong enough that a chunk's cumulative log decay reaches
hundreds (|g| up to 6 a token in the tiny Qwen3.5). Taking the decay from token j to token i
as ``exp(cum_i - cum_j)`` (``chunk_decay`` did) loses cum's float32 rounding: the chunked
delta rule was 9x less exact than its steps (transformers' chunked float32 rule is so: 1.5e-6
against its recurrent 2.2e-7 on the tiny Qwen3.5's layers), the SSD 33x in chunks of 256."""

from __future__ import annotations

import torch

from radixlm.runtime.executor.layers.gated_delta import (
    chunk_decay,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule_step,
)
from radixlm.runtime.executor.layers.mamba2 import chunk_ssd_scan, ssd_step

T, HK, H, D = 200, 2, 4, 16


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(T, HK, D, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    g = -6 * torch.rand(T, H, generator=gen, dtype=torch.float64)
    beta = torch.sigmoid(3 * torch.randn(T, H, generator=gen, dtype=torch.float64))
    return [q, k, v, g, beta]


def _token_by_token(inputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    state = torch.zeros(1, H, D, D, dtype=dtype)
    out = []
    for t in range(T):
        o, state = recurrent_gated_delta_rule_step(*(x[t:t + 1].to(dtype) for x in inputs),
                                                   state)
        out.append(o)
    return torch.cat(out).double()


def test_chunked_delta_rule_float32_as_exact_as_its_steps():
    inputs = _inputs()
    exact = _token_by_token(inputs, torch.float64)
    steps_err = (_token_by_token(inputs, torch.float32) - exact).abs().max().item()
    out, _, _ = chunk_gated_delta_rule(*(x.float() for x in inputs),
                                       torch.zeros(1, H, D, D), [T])
    chunk_err = (out.double() - exact).abs().max().item()
    assert 0 < chunk_err <= 2 * steps_err, (chunk_err, steps_err)


def test_decays_exact_to_float32_rounding():
    g = -6 * torch.rand(3, H, 64, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
    cum, pair = chunk_decay(g.float())
    cum64, pair64 = chunk_decay(g)
    assert pair.triu(1).eq(0).all() and torch.allclose(cum.double(), cum64, rtol=1e-6)
    # a decay that matters (above 1e-3: its exponent above -7) is exp of a sum of a few
    # terms: its float32 error is a few roundings of that sum, not cum's absolute rounding
    # (hundreds times 6e-8) as a difference of two cumulative sums would leave
    kept = pair64 > 1e-3
    rel = ((pair.double() - pair64).abs() / pair64)[kept].max().item()
    assert kept.sum() > 500 and rel < 1e-6, rel


def test_chunked_ssd_float32_as_exact_as_its_steps():
    gen = torch.Generator().manual_seed(0)
    heads, p, groups, n = 8, 16, 2, 16
    x = torch.randn(T, heads, p, generator=gen, dtype=torch.float64)
    dt = torch.randn(T, heads, generator=gen, dtype=torch.float64) + 1
    a_log = 2 * torch.rand(heads, generator=gen, dtype=torch.float64)  # log decays to -25
    b, c = (torch.randn(T, groups, n, generator=gen, dtype=torch.float64) for _ in range(2))
    d, dt_bias = torch.randn(heads, generator=gen, dtype=torch.float64), torch.zeros(heads)
    per_token = [x, dt, b, c]
    weights = [a_log, d, dt_bias]

    def steps(dtype: torch.dtype) -> torch.Tensor:
        state = torch.zeros(1, heads, p, n, dtype=dtype)
        out = []
        for t in range(T):
            xt, dtt, bt, ct = (v[t:t + 1].to(dtype) for v in per_token)
            a, dd, bias = (w.to(dtype) for w in weights)
            y, state = ssd_step(xt, dtt, a, bt, ct, dd, bias, state)
            out.append(y)
        return torch.cat(out).double()

    exact = steps(torch.float64)
    steps_err = (steps(torch.float32) - exact).abs().max().item()
    xs, dts, bs, cs = (v.float() for v in per_token)
    y, _, _ = chunk_ssd_scan(xs, dts, a_log.float(), bs, cs, d.float(), dt_bias.float(),
                             torch.zeros(1, heads, p, n), [T], chunk_size=256)
    chunk_err = (y.double() - exact).abs().max().item()
    assert 0 < chunk_err <= 2 * steps_err, (chunk_err, steps_err)
