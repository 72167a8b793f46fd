"""gpt-oss's MXFP4 experts kept packed on a CPU, from its Hugging Face checkpoint and from a
GGUF file: twice an E2M1 value is an integer in -12..12, so each block is an int8 weight
times a power of two (w8, group 32), which the CPU kernel packs as w6.

Oracles: the quantized weights dequantize bit for bit to ``mxfp4.dequantize`` and to the
``gguf`` package's dequantizer; the packed experts (gate and up rows interleaved from the
GGUF file's two tensors) dequantize bit for bit to the float load's parameters; greedy
tokens equal transformers' float32 on the same MXFP4 weights dequantized; the experts hold
no dense tensor and about 0.8 bytes a weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixlm.kernels import quant_linear
from radixlm.runtime.distributed.layers import Placement
from radixlm.runtime.executor.layers.moe import FusedExperts
from radixlm.runtime.executor.models import build_model, load_model, mxfp4
from radixlm.runtime.executor.quant import loader
from radixlm.runtime.executor.quant.gguf_weights import (
    GGUFSource,
    read_tensor,
    reference_dequantize,
)
from radixlm.runtime.gguf_file import open_gguf, view_dir_for
from radixlm.runtime.model_config import ModelConfig
from tests.runtime.executor.test_quantized_checkpoints import KERNEL_BOUND, _emulated, _logprobs
from tests.runtime.test_gguf_gpt_oss import (
    GREEDY,
    PROMPTS,
    exact_products,
    hf_tokens,
    make_checkpoints,
    write_gpt_oss_gguf,
)

# mean |log-probability| difference between the kernel's products and exact ones over
# PROMPTS' positions (measured on an AMD Zen 4 host: 0.36 from both sources, the largest
# 3.3 where top-2 routing flips; about 1.7x here)
LOGPROB_BOUND = 0.6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, its experts dequantized): test_gguf_gpt_oss's tiny gpt-oss."""
    return make_checkpoints(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def hand_file(checkpoints, tmp_path_factory) -> Path:
    return write_gpt_oss_gguf(checkpoints[0], tmp_path_factory.mktemp("hand") / "m.gguf")


@pytest.fixture(scope="module")
def want_tokens(checkpoints) -> list[list[int]]:
    return hf_tokens(checkpoints[1])


def _sources(checkpoints, hand_file) -> dict[str, Path]:
    """The MXFP4 checkpoint and the GGUF file's view directory (config.json, tokenizer)."""
    return {"hf": checkpoints[0], "gguf": view_dir_for(hand_file)}


def _experts(model) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def _loaded(path) -> tuple[torch.nn.Module, dict]:
    config = ModelConfig.from_hf(path)
    model = build_model(config, "cpu")
    kinds = loader.load_checkpoint(model, config, path)
    return model, kinds


def test_blocks_are_exact_quantized_weights(hand_file):
    """Every code and scale byte (E8M0 0, 1, 127, 254 among them): the w8 weight
    dequantizes to ``mxfp4.dequantize`` bit for bit, its codes fit w6; a GGUF file's
    stacked experts read as one such weight per expert, equal to gguf's dequantizer."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 16, 8, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 16, 8), generator=gen, dtype=torch.uint8)
    scales[0, 0, :4] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)
    weights = mxfp4.quant_weights(blocks, scales)
    want = mxfp4.dequantize(blocks, scales)
    for e, qw in enumerate(weights):
        assert (qw.kind, qw.shape, qw.group) == ("w8", (16, 256), 32)
        assert torch.equal(qw.dequantize(), want[e])
        assert quant_linear.packed_kind(qw) == "w6"
    assert set(torch.cat([qw.data.flatten() for qw in weights]).tolist()) == {
        0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12}
    with open_gguf(hand_file) as model:
        name = "model.layers.2.mlp.experts.up_proj"
        got = torch.stack([qw.dequantize() for qw in read_tensor(model, name)])
        assert torch.equal(got, torch.from_numpy(reference_dequantize(model, name)))


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_packed_experts_are_the_dequantized_ones(checkpoints, hand_file, source):
    """Each expert's packed gate_up (the GGUF file's gate and up rows interleaved) and down
    dequantize bit for bit to the dense load's parameters (the float path of the HF
    checkpoint; the GGUF file dequantized by the loader); no dense expert tensor is left."""
    path = _sources(checkpoints, hand_file)[source]
    model, kinds = _loaded(path)
    if source == "hf":
        dense = load_model(ModelConfig.from_hf(path), path, "cpu")
    else:
        dense = build_model(ModelConfig.from_hf(path), "cpu")
        with open_gguf(hand_file) as f:
            loader.load_quantized(dense, GGUFSource(f), dense=True)
    packed, want = _experts(model), _experts(dense)
    assert len(packed) == 4 and set(kinds) == {"w8"}
    for ours, ref in zip(packed, want):
        assert ours.gate_up_proj.is_meta and ours.down_proj.is_meta
        for e, pair in enumerate(ours.quant_experts):
            for rows, param in zip(pair, (ref.gate_up_proj[e], ref.down_proj[e])):
                (p,) = rows.packed
                assert p is not None and p.kind == "w6" and rows.blocks == [None]
                assert torch.equal(quant_linear._dequant(p, 0, p.n), param.float())


def test_interleaving_swapped_rows_would_differ():
    """The strided placement really interleaves: gate rows at 0, 2, ... and up at 1, 3, ...
    (the same two weights placed the other way round give another weight)."""
    gen = torch.Generator().manual_seed(1)
    gate, up = (mxfp4.quant_weights(torch.randint(0, 256, (1, 4, 1, 16), generator=gen,
                                                  dtype=torch.uint8),
                                    torch.full((1, 4, 1), 120, dtype=torch.uint8))[0]
                for _ in range(2))
    even, odd = slice(0, None, 2), slice(1, None, 2)
    (w,) = loader._interleaved([(even, gate), (odd, up)], 8)
    assert torch.equal(w.dequantize()[0::2], gate.dequantize())
    assert torch.equal(w.dequantize()[1::2], up.dequantize())
    (swapped,) = loader._interleaved([(odd, gate), (even, up)], 8)
    assert not torch.equal(swapped.dequantize(), w.dequantize())
    assert loader._interleaved([(even, gate), (slice(0, 4), up)], 8) is None  # not a cover
    assert loader._parts(Placement("x", (slice(None), even)), [gate, up])[1][0].rows == (1, even)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_served_tokens_and_resident_bytes(checkpoints, hand_file, want_tokens, make_engine,
                                          monkeypatch, source):
    """Greedy tokens of the packed experts (their products exact: ``exact_products``) equal
    transformers' float32 on the dequantized checkpoint; the experts take about 0.8 bytes a
    weight (bf16: 2, float32: 4)."""
    exact_products(monkeypatch)
    eng = make_engine(model_path=str(_sources(checkpoints, hand_file)[source]),
                      dtype="float32")
    runner = eng.scheduler.model_runner
    experts = _experts(runner.model)
    assert set(runner.quant_kinds) == {"w8"} and all(m.gate_up_proj.is_meta for m in experts)
    held = sum(r.nbytes() for m in experts for pair in m.quant_experts for r in pair)
    weights = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    print(f"{source}: experts {held / weights:.3f} bytes a weight (bf16 2, float32 4; "
          f"{weights} weights)")
    assert held / weights < 0.9  # 0.8125 and a float32 factor a row (4 / k bytes)
    got = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want_tokens


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_kernel_follows_its_arithmetic(checkpoints, hand_file, make_engine, monkeypatch,
                                       source):
    """With the kernel's own products (x rounded to int8 per block, as llama.cpp's q8_0
    activations): each expert product equals that arithmetic in float64 from the unpacked
    weight, and the prompts' log-probabilities stay within the bound of the exact
    products' (the tiny random model is chaotic: routing flips between near-tied experts,
    so its greedy tokens soon part from transformers')."""
    path = str(_sources(checkpoints, hand_file)[source])
    packs, errors = {}, []
    pack, linear = quant_linear.pack, quant_linear.linear

    def packing(qw):
        packed = pack(qw)
        packs[id(packed)] = qw
        return packed

    def checked(x, packed, bias=None):
        y = linear(x, packed, bias)
        want = _emulated(x, packs[id(packed)], packed, bias).double()
        errors.append(float((y.double() - want).abs().max()
                            / want.abs().max().clamp(min=1e-30)))
        return y

    with monkeypatch.context() as patch:
        patch.setattr(quant_linear, "pack", packing)
        patch.setattr(quant_linear, "linear", checked)
        got = _logprobs(make_engine(model_path=path, dtype="float32"), PROMPTS)
    assert len(errors) >= 4 * 2 * 2 and max(errors) <= KERNEL_BOUND, max(errors)
    exact_products(monkeypatch)
    want = _logprobs(make_engine(model_path=path, dtype="float32"), PROMPTS)
    diffs = [abs(a - b) for ra, rb in zip(got, want) for a, b in zip(ra, rb)]
    print(f"{source}: products within {max(errors):.1e} of the kernel's arithmetic; "
          f"|d logprob| against exact products mean {sum(diffs) / len(diffs):.4f} "
          f"max {max(diffs):.4f}")
    assert sum(diffs) / len(diffs) <= LOGPROB_BOUND


def test_without_the_kernel_library_experts_are_dequantized(checkpoints, monkeypatch):
    """Where the packed kernel is missing (or on CUDA, or split over ranks) the HF
    checkpoint's experts load dequantized, as before."""
    mx = checkpoints[0]
    monkeypatch.setattr(quant_linear, "isa", lambda: -1)
    model, kinds = _loaded(mx)
    assert not kinds
    assert all(m.quant_experts is None and not m.gate_up_proj.is_meta for m in _experts(model))
