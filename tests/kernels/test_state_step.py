"""``kernels/state_step.py`` (``csrc/state_step.cpp``): a linear-attention decode step with
its state updated in place in the pool, against the torch steps of ``layers/gated_delta.py``
and ``layers/mamba2.py`` run in float64 on the gathered states. Slots not named are left bit
for bit; bad slots are refused by name. Skipped where the library is not built."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import state_step
from radixlm.runtime.executor.layers import gated_delta as gd
from radixlm.runtime.executor.layers import mamba2 as m2
from radixlm.runtime.executor.layers import short_conv

pytestmark = pytest.mark.skipif(not state_step.supports(torch.zeros(1)),
                                reason="the CPU kernel library is not built here")

SLOTS = torch.tensor([4, 1, 5])  # three sequences in a pool of 7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4, 16, 24), (3, 3, 32, 8)])  # Hk, Hv, Dk, Dv
@pytest.mark.parametrize("l2norm", [True, False])
def test_gated_delta_step_matches_float64(dtype, heads, l2norm):
    hk, hv, dk, dv = heads
    g = _gen(hk * dk + l2norm)
    b = SLOTS.numel()
    pool = torch.randn(7, hv, dk, dv, generator=g)
    before = pool.clone()
    q, k = (torch.randn(b, hk, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(b, hv, dv, generator=g).to(dtype)
    gate = -torch.rand(b, hv, generator=g) * 2
    beta = torch.rand(b, hv, generator=g)
    scale = None if l2norm else 0.3  # unnormalised q and k: keep the state's growth small
    out = state_step.gated_delta_step(q, k, v, gate, beta, pool, SLOTS, scale, l2norm)
    want_o, want_s = gd.recurrent_gated_delta_rule_step(
        q.double(), k.double(), v.double(), gate.double(), beta.double(),
        before[SLOTS].double(), scale, l2norm)
    assert out.dtype == torch.float32 and out.shape == (b, hv, dv)
    tol = 2e-5 * (1 + want_s.abs().amax())
    assert (pool[SLOTS].double() - want_s).abs().max() <= tol
    assert (out.double() - want_o).abs().max() <= tol * (dk if not l2norm else 1)
    others = [i for i in range(7) if i not in SLOTS.tolist()]
    assert torch.equal(pool[others], before[others])


def test_gated_delta_steps_follow_the_torch_path():
    """Ten steps in place equal ten steps of the torch function on gathered states (float32,
    within a few ulps of the state's size)."""
    g = _gen(7)
    hk, hv, dk, dv, b = 2, 4, 32, 32, 3
    pool = torch.zeros(7, hv, dk, dv)
    state = torch.zeros(b, hv, dk, dv)
    for _ in range(10):
        q, k = (torch.randn(b, hk, dk, generator=g) for _ in range(2))
        v = torch.randn(b, hv, dv, generator=g)
        gate, beta = -torch.rand(b, hv, generator=g), torch.rand(b, hv, generator=g)
        out = state_step.gated_delta_step(q, k, v, gate, beta, pool, SLOTS)
        want, state = gd.recurrent_gated_delta_rule_step(q, k, v, gate, beta, state)
        assert (out - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    assert (pool[SLOTS] - state).abs().max() <= 1e-5 * (1 + state.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_step_matches_float64(dtype, pool_dtype, bias, activation):
    g = _gen(3)
    b, c, kw = SLOTS.numel(), 40, 4
    pool = torch.randn(7, c, kw - 1, generator=g).to(pool_dtype)
    before = pool.clone()
    x = torch.randn(b, c, generator=g).to(dtype)
    weight = torch.randn(c, kw, generator=g).to(dtype)
    bv = torch.randn(c, generator=g) if bias else None
    out = state_step.conv1d_step(x, weight, bv, pool, SLOTS, activation)
    want, want_state = short_conv.causal_conv1d_step(x.double(), weight.double(),
                                             None if bv is None else bv.double(),
                                             before[SLOTS].double(), activation)
    assert out.dtype == dtype and out.shape == (b, c)
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    assert ((out.double() - want).abs() <= ulp * (1 + want.abs())).all()
    # the window shifted by one: the state's own values, then x rounded to the pool's dtype
    assert torch.equal(pool[SLOTS], want_state.to(pool_dtype))
    others = [i for i in range(7) if i not in SLOTS.tolist()]
    assert torch.equal(pool[others], before[others])


def _mamba2_inputs(g: torch.Generator, heads: int, head_dim: int, groups: int, d_state: int,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One token of x | B | C (after the conv) and dt for the sequences of SLOTS, and the
    heads' parameters (dt + dt_bias around -2: softplus ~ 0.02 .. 0.7)."""
    b = SLOTS.numel()
    width = heads * head_dim + 2 * groups * d_state
    return {"xbc": torch.randn(b, width, generator=g).to(dtype),
            "dt": (torch.randn(b, heads, generator=g) - 1).to(dtype),
            "A_log": torch.rand(heads, generator=g) * 2.5, "D": torch.randn(heads, generator=g),
            "dt_bias": torch.randn(heads, generator=g) - 1}


def _ssd_reference(inp: dict[str, torch.Tensor], state: torch.Tensor, groups: int,
                   dt_limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/mamba2.py``'s ssd_step on x, B, C split out of xbc, in float64."""
    heads, head_dim, d_state = state.shape[1:]
    spec = m2.Mamba2Spec(heads, head_dim, groups, d_state)
    x, B, C = m2._split_xbc(inp["xbc"].double(), spec)
    return m2.ssd_step(x, inp["dt"].double(), inp["A_log"].double(), B, C, inp["D"].double(),
                       inp["dt_bias"].double(), state.double(), dt_limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 5, 2, 7), (3, 4, 3, 16), (4, 8, 1, 9)])  # H, P, G, N
@pytest.mark.parametrize("dt_limit", [m2.NO_DT_LIMIT, (0.05, 0.4)])
def test_mamba2_step_matches_float64(dtype, shape, dt_limit):
    heads, head_dim, groups, d_state = shape
    g = _gen(heads * d_state + int(dt_limit[0] * 100))
    pool = torch.randn(7, heads, head_dim, d_state, generator=g)
    before = pool.clone()
    inp = _mamba2_inputs(g, heads, head_dim, groups, d_state, dtype)
    out = state_step.mamba2_step(**inp, ssm=pool, slots=SLOTS, dt_limit=dt_limit)
    want_y, want_s = _ssd_reference(inp, before[SLOTS], groups, dt_limit)
    assert out.dtype == dtype and out.shape == (SLOTS.numel(), heads, head_dim)
    tol = 2e-5 * (1 + want_s.abs().amax())
    assert (pool[SLOTS].double() - want_s).abs().max() <= tol
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # y rounded once to x's dtype
    assert ((out.double() - want_y).abs() <= ulp * want_y.abs() + tol * d_state).all()
    others = [i for i in range(7) if i not in SLOTS.tolist()]
    assert torch.equal(pool[others], before[others])


def test_mamba2_mixer_steps_in_place_follow_the_torch_path():
    """Ten decode steps of the whole mixer (conv with its bias, SSD, gated grouped norm) in
    place in a pool equal ten steps of ``mamba2_mixer_step`` on gathered states (float32,
    within a few ulps)."""
    g = _gen(11)
    spec = m2.Mamba2Spec(num_heads=6, head_dim=4, n_groups=2, d_state=8, dt_limit=(0.0, 0.6))
    inter, conv_dim, kernel, b = spec.intermediate_size, spec.conv_dim, 4, SLOTS.numel()
    weights = m2.Mamba2Weights(
        torch.randn(conv_dim, kernel, generator=g) * 0.5, torch.randn(conv_dim, generator=g),
        torch.randn(6, generator=g) - 1, torch.rand(6, generator=g) * 2,
        torch.randn(6, generator=g),
        1 + 0.1 * torch.randn(inter, generator=g))
    conv_pool = torch.zeros(7, conv_dim, kernel - 1)
    ssm_pool = torch.zeros(7, *spec.ssm_shape)
    state = gd.RecurrentState.zeros(b, conv_dim, kernel, spec.ssm_shape, torch.float32)
    for _ in range(10):
        gate, xbc = torch.randn(b, inter, generator=g), torch.randn(b, conv_dim, generator=g)
        dt = torch.randn(b, 6, generator=g)
        out = m2.mamba2_mixer_step_in_place(gate, xbc, dt, weights, spec, conv_pool, ssm_pool,
                                            SLOTS)
        want, state = m2.mamba2_mixer_step(gate, xbc, dt, weights, spec, state)
        assert (out - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    assert torch.equal(conv_pool[SLOTS], state.conv)  # the last inputs, copied as they are
    assert (ssm_pool[SLOTS] - state.ssm).abs().max() <= 1e-5 * (1 + state.ssm.abs().max())
    others = [i for i in range(7) if i not in SLOTS.tolist()]
    assert not conv_pool[others].any() and not ssm_pool[others].any()


@pytest.mark.parametrize("slots, match", [(torch.tensor([4, 4, 5]), "twice"),
                                          (torch.tensor([4, 7, 5]), "outside the pool"),
                                          (torch.tensor([4, -1, 5]), "outside the pool")])
def test_bad_slots_are_refused(slots, match):
    g = _gen(0)
    pool = torch.zeros(7, 2, 8, 8)
    q = torch.randn(3, 2, 8, generator=g)
    with pytest.raises(RuntimeError, match=match):
        state_step.gated_delta_step(q, q, torch.randn(3, 2, 8), torch.zeros(3, 2),
                                    torch.ones(3, 2), pool, slots)
    with pytest.raises(RuntimeError, match=match):
        state_step.conv1d_step(torch.randn(3, 5), torch.randn(5, 4), None,
                               torch.zeros(7, 5, 3), slots)
    inp = _mamba2_inputs(g, 2, 8, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match=match):
        state_step.mamba2_step(**inp, ssm=pool, slots=slots)
    assert not pool.any()


def test_mamba2_step_refuses_groups_that_do_not_split_the_heads():
    """xbc of 3 groups for 4 heads: refused by name, the pool untouched."""
    pool = torch.zeros(7, 4, 2, 5)
    inp = _mamba2_inputs(_gen(1), 4, 2, 3, 5, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of G"):
        state_step.mamba2_step(**inp, ssm=pool, slots=SLOTS)
    assert not pool.any()
