"""float32 linears on FMAs (``kernels/fma_linear.py``, ``csrc/fma_linear.cpp``): against a
float64 oracle (float32 sums in order over K: within K float32 roundings of the exact
result), against oneDNN's float32 linear (the counterpart it replaces), at every tail of
rows (blocks of 8 on AVX-512, 6 on AVX2), columns (panels of 48 or 16) and K, with and
without a bias, strided and 3-D inputs; bfloat16 panels (AVX2) against the float64 oracle
rounded to bfloat16; and the layers' dispatch: a float32 layer on an AVX-512 CPU holds both
packed copies and sends products of at most max_rows() rows here, the rest to oneDNN; on
AVX2 it holds the panels alone and sends the rest to torch's matmul over the dense weight,
and a bfloat16 layer sends every product to its bf16 panels.
Skipped where the build has neither."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import fma_linear
from radixlm.runtime.distributed import layers as layers_module
from radixlm.runtime.distributed.layers import ColumnParallelLinear, Shard, prepack_weights
from tests.kernels.linear_layers import small_layers

needs_fma = pytest.mark.skipif(not fma_linear.supports(torch.zeros(1, 1)),
                               reason="no AVX-512 or AVX2 build here")


def _inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1,
            torch.randn(n, generator=g))


def _check_f64(y, x, w, bias):
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    sums = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    err = (y.double() - exact).abs()
    assert (err <= sums * (x.shape[-1] + 1) * 2.0**-24 + 1e-30).all(), err.max()


@needs_fma
@pytest.mark.parametrize("m,n,k", [
    (1, 48, 1), (1, 4096, 768), (3, 7, 33), (7, 47, 50), (8, 49, 64), (9, 96, 17),
    (16, 100, 96), (31, 1280, 768), (32, 768, 2048), (33, 97, 64), (70, 768, 200),
])
@pytest.mark.parametrize("bias", [None, "f32", "bf16"])
def test_matches_float64(m, n, k, bias):
    x, w, b = _inputs(m, n, k, seed=m * 1000 + n + k)
    bias_t = {None: None, "f32": b, "bf16": b.bfloat16()}[bias]
    y = fma_linear.linear(x, fma_linear.pack(w), n, bias_t)
    assert y.shape == (m, n) and y.dtype == torch.float32
    _check_f64(y, x, w, None if bias_t is None else bias_t.float())


@needs_fma
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_split_and_thread_count_gives_each_rows_own_bits(threads, dtype):
    """Rows are split into blocks of even sizes (1-20 rows: every split; 96 / 97 rows: the
    last count whose panels are fetched ahead, and the first not), threads take panels from
    a shared counter: each output is still its row's sum over K in order, so every row of a
    product has the bits of that row multiplied alone, and nothing is skipped or repeated."""
    if dtype == torch.bfloat16 and not fma_linear.supports(torch.zeros(1, 1).bfloat16()):
        pytest.skip("bfloat16 panels are the AVX2 build's")
    n, k = 16 * 9 + 5, 70
    x, w, b = _inputs(97, n, k, seed=7)
    packed = fma_linear.pack(w.to(dtype))
    alone = torch.cat([fma_linear.linear(x[i:i + 1], packed, n, b) for i in range(97)])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in [*range(1, 21), 31, 32, 96, 97]:
            y = fma_linear.linear(x[:m], packed, n, b)
            assert torch.equal(y, alone[:m]), m
    finally:
        torch.set_num_threads(before)
    _check_f64(alone, x, w.to(dtype).float(), b)


@needs_fma
@pytest.mark.parametrize("m", [1, 8, 24, 32])
@pytest.mark.parametrize("n,k", [(1280, 768), (768, 2048)])
def test_close_to_onednn(m, n, k):
    x, w, b = _inputs(m, n, k, seed=m + n)
    ours = fma_linear.linear(x, fma_linear.pack(w), n, b)
    theirs = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, None), b, "none", [], "")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_fma
def test_strided_3d_and_empty_inputs():
    x, w, b = _inputs(6, 50, 64, seed=1)
    packed = fma_linear.pack(w)
    strided = torch.randn(6, 128)[:, ::2]
    assert not strided.is_contiguous()
    _check_f64(fma_linear.linear(strided, packed, 50, b), strided, w, b)
    rows = torch.randn(12, 64)[::2]  # rows apart, each contiguous
    _check_f64(fma_linear.linear(rows, packed, 50, b), rows, w, b)
    y3 = fma_linear.linear(x.reshape(2, 3, 64), packed, 50, b)
    assert y3.shape == (2, 3, 50)
    torch.testing.assert_close(y3.reshape(6, 50), fma_linear.linear(x, packed, 50, b),
                               rtol=0, atol=0)
    assert fma_linear.linear(x[:0], packed, 50, b).shape == (0, 50)


@needs_fma
def test_a_packing_of_another_shape_is_refused():
    x, w, _ = _inputs(4, 64, 64, seed=2)
    packed = fma_linear.pack(w)
    with pytest.raises(RuntimeError, match="not fma_pack_linear's packing"):
        fma_linear.linear(x, packed, 100, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        fma_linear.linear(x, packed, 64, torch.zeros(63))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fma_linear.linear(x.half(), packed, 64, None)


@needs_fma
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 100, 2049])
def test_layers_send_the_products_it_runs_faster_to_the_panels(rows, monkeypatch):
    layers = small_layers(96)
    assert prepack_weights(torch.nn.ModuleList(layers)) == 3
    every = fma_linear.replaces_onednn()  # the AVX2 build: no oneDNN copy
    assert every == (fma_linear.panel_columns() == 16)
    assert fma_linear.max_rows() == (2048 if every else 32)
    assert all(m.fma_packed is not None and (m.packed is None) == every
               and m.amx_packed is None and m.is_prepacked() for m in layers)
    assert all(m.packed_nbytes() == (0 if every else m.weight.nbytes) + m.fma_packed.nbytes
               for m in layers)
    panel = fma_linear.panel_columns()
    assert all(m.fma_packed.numel() == -(-m.weight.shape[0] // panel) * panel * 96
               for m in layers)
    calls, dense = [], []
    real, real_dense = fma_linear.linear, layers_module.F.linear
    monkeypatch.setattr(fma_linear, "linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(layers_module.F, "linear",
                        lambda *a, **k: dense.append(1) or real_dense(*a, **k))
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        for m in layers:
            _check_f64(m(x), x, m.weight, getattr(m, "bias", None))
    assert len(calls) == (3 if rows <= fma_linear.max_rows() else 0)
    # past the panels: oneDNN's copy on AVX-512, torch's matmul over the dense weight on AVX2
    assert len(dense) == (3 if every and rows > fma_linear.max_rows() else 0)
    prepack_weights(torch.nn.ModuleList(layers), on=False)
    assert all(m.fma_packed is None and m.packed is None and not m.is_prepacked()
               for m in layers)


def test_bfloat16_panels_only_on_avx2_and_none_without_the_build(monkeypatch):
    bf16 = ColumnParallelLinear(64, {"q": Shard(0, 0, 32, 32)}, False).to(torch.bfloat16)
    prepack_weights(torch.nn.ModuleList([bf16]))
    avx2 = fma_linear.supports(torch.zeros(1, 1)) and fma_linear.replaces_onednn()
    assert (bf16.fma_packed is not None) == avx2
    assert bf16.fma_packed is None or (bf16.fma_packed.dtype == torch.bfloat16
                                       and bf16.packed is None)
    monkeypatch.setattr(fma_linear, "_ready", lambda: False)
    layers = small_layers(96)
    prepack_weights(torch.nn.ModuleList(layers))
    assert all(m.fma_packed is None and m.packed is not None for m in layers)
    x = torch.randn(4, 96)
    with torch.inference_mode():
        for m in layers:
            _check_f64(m(x), x, m.weight, getattr(m, "bias", None))


def _check_bf16(y, x, w, bias):
    """y: the float32 sum (within K float32 roundings of the exact one) rounded to bf16."""
    assert y.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    sums = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    f32 = sums * (x.shape[-1] + 1) * 2.0**-24
    err = (y.double() - exact).abs()
    assert (err <= f32 + (exact.abs() + f32) * 2.0**-8 + 1e-30).all(), err.max()


needs_bf16_panels = pytest.mark.skipif(
    not (fma_linear.supports(torch.zeros(1, 1)) and fma_linear.replaces_onednn()),
    reason="bfloat16 panels are the AVX2 build's")


@needs_bf16_panels
@pytest.mark.parametrize("m,n,k", [(1, 16, 1), (3, 7, 33), (7, 47, 50), (32, 1280, 768),
                                   (70, 100, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_panels_match_float64(m, n, k, bias):
    x, w, b = _inputs(m, n, k, seed=m * 7 + n + k)
    x, w, b = x.bfloat16(), w.bfloat16(), (b.bfloat16() if bias else None)
    packed = fma_linear.pack(w)
    assert packed.dtype == torch.bfloat16
    y = fma_linear.linear(x, packed, n, b)
    assert y.shape == (m, n)
    _check_bf16(y, x, w, b)
    # a float32 x over the same panels: float32 out, the float32 bound
    y32 = fma_linear.linear(x.float(), packed, n, b)
    assert y32.dtype == torch.float32
    _check_f64(y32, x.float(), w.float(), None if b is None else b.float())


@needs_bf16_panels
@pytest.mark.parametrize("rows", [1, 33, 2049])
def test_bfloat16_layers_send_every_product_to_the_panels(rows, monkeypatch):
    layers = [m.to(torch.bfloat16) for m in small_layers(96)]
    assert prepack_weights(torch.nn.ModuleList(layers)) == 3
    assert all(m.fma_packed.dtype == torch.bfloat16 and m.packed is None
               and m.packed_nbytes() == m.fma_packed.nbytes for m in layers)
    calls, dense = [], []
    real = fma_linear.linear
    monkeypatch.setattr(fma_linear, "linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(layers_module.F, "linear", lambda *a, **k: dense.append(1))
    x = torch.randn(rows, 96).bfloat16()
    with torch.inference_mode():
        for m in layers:
            _check_bf16(m(x), x, m.weight, getattr(m, "bias", None))
    assert len(calls) == 3 and not dense
