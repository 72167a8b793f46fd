"""bfloat16 linears of few rows on AMX tiles, or AVX512-BF16 dot products on a CPU without
AMX (``kernels/amx_linear.py``,
``csrc/amx_linear.cpp``): against a float64 oracle over the bf16 values (float32 sums, so
each element within half a bf16 ulp of the exact result plus the sums' rounding), against
oneDNN's bf16 linear (the counterpart it replaces in decode steps: within one bf16 ulp),
at every tail of rows, columns and K, with and without a bias (bf16 or float32), strided
and 3-D inputs; and the layers' dispatch: a bf16 layer on an AMX CPU holds both packed
copies and sends products of at most MAX_ROWS rows here, the rest to oneDNN. Skipped where
the CPU has neither (the path the CPU takes is the one tested)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import amx_linear
from radixlm.runtime.distributed.layers import ColumnParallelLinear, Shard, prepack_weights
from tests.kernels.linear_layers import small_layers

needs_amx = pytest.mark.skipif(not amx_linear.supports(torch.zeros(1, 1, dtype=torch.bfloat16)),
                               reason="neither AMX-BF16 nor AVX512-BF16 here")
BF16 = torch.bfloat16


def _inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF16)
    x = torch.randn(m, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16)
    return x, w, b


def _check_f64(y, x, w, bias):
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    sums = x.double().abs() @ w.double().abs().T  # bounds the float32 sums' rounding
    err = (y.double() - exact).abs()
    assert (err <= exact.abs() * 2.0**-8 + sums * 2.0**-20 + 1e-30).all(), err.max()


@needs_amx
@pytest.mark.parametrize("m,n,k", [
    (1, 32, 32), (1, 4096, 768), (3, 7, 33), (5, 40, 50), (16, 64, 64), (17, 100, 96),
    (31, 1280, 768), (32, 768, 2048), (33, 96, 64), (48, 33, 160), (70, 768, 2048),
])
@pytest.mark.parametrize("bias", [None, "bf16", "f32"])
def test_matches_float64(m, n, k, bias):
    x, w, b = _inputs(m, n, k, seed=m * 1000 + n + k)
    bias_t = {None: None, "bf16": b, "f32": b.float()}[bias]
    y = amx_linear.linear(x, amx_linear.pack(w), n, bias_t)
    assert y.shape == (m, n) and y.dtype == BF16
    _check_f64(y, x, w, None if bias_t is None else bias_t.to(BF16))


@needs_amx
@pytest.mark.parametrize("m", [1, 8, 16, 24, 32])
@pytest.mark.parametrize("n,k", [(1280, 768), (768, 2048), (4096, 768)])
def test_within_one_ulp_of_onednn(m, n, k):
    x, w, b = _inputs(m, n, k, seed=m + n)
    ours = amx_linear.linear(x, amx_linear.pack(w), n, b).double()
    theirs = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, None), b, "none", [], "").double()
    ulp = torch.maximum(ours.abs(), theirs.abs()) * 2.0**-7
    # plus both float32 sums' rounding, where the terms cancel to a result near zero (their
    # orders differ without AMX: oneDNN's AVX512-BF16 kernel blocks K its own way)
    sums = x.double().abs() @ w.double().abs().T
    assert ((ours - theirs).abs() <= ulp + sums * 2.0**-19 + 1e-30).all()
    assert (ours == theirs).float().mean() > 0.9  # the same sums, rounded the same way


@needs_amx
def test_strided_3d_and_empty_inputs():
    x, w, b = _inputs(6, 48, 64, seed=1)
    packed = amx_linear.pack(w)
    wide = torch.randn(6, 128).to(BF16)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    _check_f64(amx_linear.linear(strided, packed, 48, b), strided, w, b)
    rows_of_wider = wide[:, 32:96]  # contiguous rows 128 apart: copied row by row
    assert rows_of_wider.stride() == (128, 1)
    _check_f64(amx_linear.linear(rows_of_wider, packed, 48, b), rows_of_wider, w, b)
    x3 = x.reshape(2, 3, 64)
    y3 = amx_linear.linear(x3, packed, 48, b)
    assert y3.shape == (2, 3, 48)
    torch.testing.assert_close(y3.reshape(6, 48), amx_linear.linear(x, packed, 48, b), rtol=0,
                               atol=0)
    assert amx_linear.linear(x[:0], packed, 48, b).shape == (0, 48)


@needs_amx
def test_a_packing_of_another_shape_is_refused():
    x, w, _ = _inputs(4, 64, 64, seed=2)
    packed = amx_linear.pack(w)
    with pytest.raises(RuntimeError, match="not amx_pack_linear's packing"):
        amx_linear.linear(x, packed, 96, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        amx_linear.linear(x, packed, 64, torch.zeros(63, dtype=BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx_linear.linear(x.float(), packed, 64, None)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, amx_linear.MAX_ROWS, amx_linear.MAX_ROWS + 1, 100])
def test_layers_send_few_rows_to_the_tiles(rows, monkeypatch):
    layers = small_layers(96, BF16)
    assert prepack_weights(torch.nn.ModuleList(layers)) == 3
    assert all(m.amx_packed is not None and m.packed is not None for m in layers)
    assert all(m.packed_nbytes() == m.weight.nbytes + m.amx_packed.nbytes for m in layers)
    calls = []
    real = amx_linear.linear
    monkeypatch.setattr(amx_linear, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, 96).to(BF16)
    with torch.inference_mode():
        for m in layers:
            bias = getattr(m, "bias", None)
            _check_f64(m(x), x, m.weight, bias)
    assert len(calls) == (3 if rows <= amx_linear.MAX_ROWS else 0)
    prepack_weights(torch.nn.ModuleList(layers), on=False)
    assert all(m.amx_packed is None and m.packed is None for m in layers)


def test_no_tile_copy_without_amx_or_for_float32(monkeypatch):
    monkeypatch.setattr(amx_linear, "_ready", lambda: False)
    layers = small_layers(96, BF16)
    prepack_weights(torch.nn.ModuleList(layers))
    assert all(m.amx_packed is None for m in layers)
    x = torch.randn(4, 96).to(BF16)
    with torch.inference_mode():
        for m in layers:
            bias = getattr(m, "bias", None)
            ref = F.linear(x.double(), m.weight.double(), None if bias is None else bias.double())
            torch.testing.assert_close(m(x).double(), ref, rtol=2e-2, atol=2e-2)
    monkeypatch.undo()
    f32 = ColumnParallelLinear(64, {"q": Shard(0, 0, 32, 32)}, False)
    prepack_weights(torch.nn.ModuleList([f32]))
    assert f32.amx_packed is None


@pytest.mark.parametrize("dot_only", [False, True])
def test_without_amx_a_long_k_takes_the_kernel_only_at_a_few_rows(dot_only, monkeypatch):
    monkeypatch.setattr(amx_linear, "_dot_only", lambda: dot_only)
    long_k = amx_linear.DOT_MAX_K + 32
    few, more = amx_linear.DOT_FEW_ROWS, amx_linear.DOT_FEW_ROWS + 1
    assert amx_linear.takes(torch.zeros(few, long_k, dtype=BF16))
    assert amx_linear.takes(torch.zeros(1, more, long_k, dtype=BF16)) == (not dot_only)
    assert amx_linear.takes(torch.zeros(amx_linear.MAX_ROWS, amx_linear.DOT_MAX_K, dtype=BF16))
    assert not amx_linear.takes(torch.zeros(amx_linear.MAX_ROWS + 1, 64, dtype=BF16))
    assert not amx_linear.takes(torch.zeros(2, 64))


@needs_amx
def test_radixlm_cpu_amx_0_turns_the_linears_off_with_the_attention():
    code = ("import torch; from radixlm.kernels import amx_linear, cpu_paged; "
            "print(amx_linear.supports(torch.zeros(2, 2, dtype=torch.bfloat16)), cpu_paged.amx())")
    env = {**os.environ, "RADIXLM_CPU_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=600).stdout.split()
    assert out == ["False", "False"]
