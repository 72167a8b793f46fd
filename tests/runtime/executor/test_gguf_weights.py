"""GGUF tensors read as our checkpoint's (``executor/quant/gguf_weights.py``): every block
type's QuantWeight equals the gguf package's own dequantizer bit for bit, llama.cpp's q/k
permutation is undone exactly, and a tiny checkpoint written by our writer reads back
within each type's error."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.torch import load_file

from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.executor.quant import gguf_weights as gw
from radixlm.runtime.executor.quant.gguf_weights import (
    GGUFSource,
    read_tensor,
    reference_dequantize,
)
from radixlm.runtime.gguf_families import TensorInfo
from radixlm.runtime.gguf_file import open_gguf
from radixlm.tiny_model import ModelShape, make_tiny_model
from radixlm.tiny_quant.gguf_writer import write_gguf

Q = GGMLQuantizationType
# byte offsets of each block's float16 scales (random bytes there could be NaN or inf)
F16_AT = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
          Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82)}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes for an [n, k] tensor of ``qtype`` (every code and scale bit pattern),
    with finite float16 scales of both signs and several magnitudes."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        d = rng.standard_normal(raw.shape[0]) * 10.0 ** rng.integers(-6, 3, raw.shape[0])
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K,
                                   Q.Q6_K])
def test_every_block_type_is_exact(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 7, 3 * block  # an odd row count, several blocks per row
    raw = random_blocks(qtype, n, k)
    qw = gw._quant_weight(raw, TensorInfo("w", "w", int(qtype), (n, k), 0, raw.size))
    assert isinstance(qw, QuantWeight) and qw.shape == (n, k)
    qw.check()
    want = quants.dequantize(raw, qtype).reshape(n, k)
    got = qw.dequantize().numpy()
    assert np.isfinite(want).all()
    assert np.array_equal(got, want), (qtype.name, np.abs(got - want).max())
    # the codes are what the format says: a wrong nibble order cannot pass by luck
    assert {"w4": (0, 15), "w8": (-128, 127)}[qw.kind][0] <= qw.codes().min()


def test_permuted_quant_rows_are_exact(tmp_path):
    raw = random_blocks(Q.Q4_K, 64, 256)
    info = TensorInfo("q", "blk.0.attn_q.weight", int(Q.Q4_K), (64, 256), 0, raw.size,
                      unpermute_heads=4)
    got = gw._quant_weight(raw, info).dequantize().numpy()
    want = quants.dequantize(raw, Q.Q4_K).reshape(64, 256)
    # llama.cpp's permute written out: GGUF row h*d + 2i + j is HF row h*d + j*d/2 + i
    hf = want.reshape(4, 8, 2, 256).transpose(0, 2, 1, 3).reshape(64, 256)
    assert np.array_equal(got, hf)


def test_other_types_dequantize_with_a_warning(caplog):
    raw = random_blocks(Q.Q3_K, 4, 256)
    info = TensorInfo("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight", int(Q.Q3_K),
                      (4, 256), 0, raw.size)
    with caplog.at_level(logging.WARNING):
        got = gw._float(raw, info)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), quants.dequantize(raw, Q.Q3_K).reshape(4, 256))
    assert "Q3_K" in caplog.text and "blk.0.ffn_up.weight" in caplog.text


# --- files from our writer ---


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    """A tiny Llama whose rows are whole k-quant super-blocks (hidden 256)."""
    shape = ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                       intermediate=512)
    return make_tiny_model(tmp_path_factory.mktemp("k") / "llama", shape=shape)


def hf_tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_f32_file_is_the_checkpoint_and_rows_were_permuted(tmp_path, tiny_llama_dir):
    hf = hf_tensors(tiny_llama_dir)
    with open_gguf(write_gguf(tiny_llama_dir, tmp_path / "f32.gguf", "F32")) as model:
        assert set(model.tensors) == set(hf)
        for name, want in hf.items():
            got = read_tensor(model, name)
            assert isinstance(got, torch.Tensor) and torch.equal(got, want), name
        # in the file, q / k rows are in llama.cpp's order, not HF's
        q = "model.layers.0.self_attn.q_proj.weight"
        stored = torch.from_numpy(reference_dequantize(model, q))
        assert not torch.equal(stored, hf[q])
        heads, d = 4, 32
        assert torch.equal(stored, hf[q].reshape(heads, 2, d // 2, -1).swapaxes(1, 2)
                           .reshape(hf[q].shape))


# type -> largest relative Frobenius error of a linear
BOUNDS = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 8e-3, "Q6_K": 3e-2, "Q5_K": 5e-2,
          "Q5_0": 5e-2, "Q4_K": 0.1, "Q4_0": 0.12, "Q4_K_M": 0.1}


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_tiny_round_trip_within_the_types_error(qtype, tmp_path, k_model):
    hf = hf_tensors(k_model)
    with open_gguf(write_gguf(k_model, tmp_path / f"{qtype}.gguf", qtype)) as model:
        ffn = model.tensors["model.layers.0.mlp.gate_proj.weight"]
        down = model.tensors["model.layers.0.mlp.down_proj.weight"]
        main = "Q4_K" if qtype == "Q4_K_M" else qtype
        assert ffn.type_name == main  # no silent fallback
        assert down.type_name == ("Q6_K" if qtype == "Q4_K_M" else main)
        worst = 0.0
        for name, want in hf.items():
            got = read_tensor(model, name)
            if want.dim() == 1:  # norms stay F32: exact
                assert torch.equal(got, want), name
                continue
            quantized = qtype not in ("F16", "BF16")
            assert isinstance(got, QuantWeight) == quantized, name
            dense = got.dequantize() if quantized else got.float()
            # the reader's rows are HF's: the file's own dequantizer, un-permuted, agrees
            err = ((dense - want).norm() / want.norm()).item()
            worst = max(worst, err)
        assert 0 < worst < BOUNDS[qtype], worst


def test_experts_are_slices_of_the_stacked_tensor(tmp_path, family_dirs):
    hf = hf_tensors(family_dirs["qwen3_moe"])
    path = write_gguf(family_dirs["qwen3_moe"], tmp_path / "moe.gguf", "Q8_0")
    with open_gguf(path) as model:
        stacked = model.raw["blk.0.ffn_gate_exps.weight"]
        assert stacked.dims == (64, 32, 8)  # GGML order: in, out, experts
        blocks = np.fromfile(path, np.uint8, stacked.nbytes, offset=stacked.offset)
        whole = quants.dequantize(blocks, Q.Q8_0).reshape(8, 32, 64)
        for e in range(8):
            name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
            info = model.tensors[name]
            assert info.shape == (32, 64)
            got = read_tensor(model, name)
            assert np.array_equal(got.dequantize().numpy(), whole[e])
            err = ((got.dequantize() - hf[name]).norm() / hf[name].norm()).item()
            assert err < 8e-3
        assert "model.layers.1.mlp.gate_proj.weight" in model.tensors  # the dense layer
        assert model.hf_config()["mlp_only_layers"] == [1]


def test_gemma_norms_and_the_source(tmp_path, family_dirs):
    hf = hf_tensors(family_dirs["gemma3"])
    with open_gguf(write_gguf(family_dirs["gemma3"], tmp_path / "g.gguf", "Q8_0")) as model:
        norm = "model.layers.0.self_attn.q_norm.weight"
        assert model.tensors[norm].norm_shift == -1.0
        stored = torch.from_numpy(reference_dequantize(model, norm))
        assert torch.allclose(stored, hf[norm] + 1)  # llama.cpp stores 1 + w
        assert torch.allclose(read_tensor(model, norm), hf[norm], atol=1e-6)
        source = GGUFSource(model)
        shapes = source.shapes()
        assert shapes == {name: tuple(t.shape) for name, t in hf.items()}
        assert isinstance(source.read("model.layers.2.mlp.up_proj.weight"), QuantWeight)
