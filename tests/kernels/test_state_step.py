"""``kernels/state_step.py`` (``csrc/state_step.cpp``): a linear-attention decode step with
its state updated in place in the pool, against the torch steps of ``layers/gated_delta.py``
run in float64 on the gathered states. Slots not named are left bit for bit; bad slots are
refused by name. Skipped where the library is not built."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import state_step
from radixlm.runtime.executor.layers import gated_delta as gd

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
    want, want_state = gd.causal_conv1d_step(x.double(), weight.double(),
                                             None if bv is None else bv.double(),
                                             before[SLOTS].double(), activation)
    assert out.dtype == dtype and out.shape == (b, c)
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    assert ((out.double() - want).abs() <= ulp * (1 + want.abs())).all()
    # the window shifted by one: the state's own values, then x rounded to the pool's dtype
    assert torch.equal(pool[SLOTS], want_state.to(pool_dtype))
    others = [i for i in range(7) if i not in SLOTS.tolist()]
    assert torch.equal(pool[others], before[others])


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
    assert not pool.any()
