"""Prepacked CPU weights (``layers.Prepackable``): the linear layers and the LM head give
float64 F.linear's outputs whether they multiply by oneDNN's packed copy or the dense
weight (bfloat16 weights: packed where the CPU has bf16 instructions), at every row
count a step can have; a weight changed in place needs ``prepack`` again (what the
model runner does after a weight update)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import fma_linear
from radixlm.runtime.distributed import layers as layers_module
from radixlm.runtime.distributed.layers import can_prepack, prepack_weights
from tests.kernels.linear_layers import small_layers

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN")


def _layers() -> list[torch.nn.Module]:
    return small_layers(48, row_bias=True)


def _f64(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    bias = getattr(m, "bias", None)
    return F.linear(x.double(), m.weight.double(), None if bias is None else bias.double())


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 130])
def test_packed_and_dense_both_match_f64(rows):
    layers = _layers()
    model = torch.nn.ModuleList(layers)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        dense = [m(x) for m in layers]
        assert prepack_weights(model) == 3
        assert all(m.is_prepacked() for m in layers)
        packed = [m(x) for m in layers]
    for m, a, b in zip(layers, dense, packed):
        ref = _f64(m, x)
        assert a.shape == b.shape == ref.shape
        torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.double(), ref, rtol=1e-5, atol=1e-5)
    assert prepack_weights(model, on=False) == 0
    assert not any(m.is_prepacked() for m in layers)


@needs_onednn
def test_a_weight_changed_in_place_needs_prepack_again():
    col = _layers()[0]
    col.prepack()
    x = torch.randn(4, 48)
    with torch.inference_mode():
        col.weight.mul_(2.0)
        stale = col(x)
        col.prepack()
        fresh = col(x)
    ref = _f64(col, x)
    assert not torch.allclose(stale.double(), ref, atol=1e-3)  # the copy is of the old weight
    torch.testing.assert_close(fresh.double(), ref, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("has_bf16", [True, False])
def test_bf16_weights_are_packed_where_the_cpu_has_bf16(has_bf16, monkeypatch):
    # with bf16 instructions oneDNN's bf16 kernels (AMX / AVX512-BF16) beat torch's matmul;
    # without them oneDNN emulates bf16 and the dense weight is kept. oneDNN packs bf16 only
    # on AVX-512 (BW/VL/DQ) CPUs: told "bf16" on an AVX2 one, it would refuse. The AVX2 build
    # of our kernels packs bf16 panels instead (fma_linear), with or without bf16
    # instructions, and makes no oneDNN copy
    monkeypatch.setattr(layers_module, "cpu_has_bf16", lambda: has_bf16)
    layers = [m.to(torch.bfloat16) for m in _layers()]
    panels = fma_linear.supports(layers[0].weight)
    packs = has_bf16 and torch.cpu._is_avx512_supported() and not panels
    assert prepack_weights(torch.nn.ModuleList(layers)) == (3 if packs or panels else 0)
    assert all((m.packed is not None) == packs and (m.fma_packed is not None) == panels
               for m in layers)
    x = torch.randn(33, 48).to(torch.bfloat16)
    with torch.inference_mode():
        for m in layers:
            torch.testing.assert_close(m(x).double(), _f64(m, x), rtol=2e-2, atol=2e-2)
    half = [m.to(torch.float16) for m in _layers()]
    assert not any(can_prepack(m.weight) for m in half)


def test_a_build_that_cannot_prepack_keeps_every_layer_dense(monkeypatch):
    # some oneDNN builds (ARM's) lack the reorder op: the model must still load and serve
    layers = _layers()
    layers[0].prepack()  # a packed copy from before must not survive either

    def unsupported(*args, **kwargs):
        raise RuntimeError("mkldnn reorder: unsupported on this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", unsupported)
    monkeypatch.setattr(fma_linear, "_ready", lambda: False)  # nor our kernel (not x86)
    monkeypatch.setattr("radixlm.runtime.distributed.layers.can_prepack", lambda w: True)
    assert prepack_weights(torch.nn.ModuleList(layers)) == 0
    assert not any(m.is_prepacked() for m in layers)
    x = torch.randn(2, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layers[2](x).double(), _f64(layers[2], x), rtol=1e-5,
                                   atol=1e-5)
