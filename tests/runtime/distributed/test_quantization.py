"""Weight-only int8 (``--torchao-config int8wo``): in float32 the Engine's greedy output is
transformers' on the dequantized weights (``q * scales``), at tp_size 1 and 2 and after a
weight update; the dense projection weights are gone (weight_bytes falls by what they
took); bf16 takes the weight-only w8 kernel (``quant_linear``, kind w8wo) where the CPU has
AVX512-BF16, else torch's packed int8 kernel, and a weight update re-packs it; every other
value is refused naming the flag."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.kernels import quant_linear
from radixlm.kernels.int8_linear import quantize_per_channel
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed.quantization import (
    quantizable_layers,
    quantized_layers,
    quantized_weight_bytes,
)
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.server_args_cli import add_server_args, server_args_from_cli

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [[11, 12, 13, 14, 15, 16], list(range(40, 75)), [7, 300, 9, 41, 1200]]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_dequantized_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers in float32 with every projection replaced by its int8 * scales."""
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rpartition(".")[2] in PROJ:
                q, s = quantize_per_channel(module.weight)
                module.weight.copy_(q.float() * s[:, None])
        outs = []
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(ids):])
    return outs


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def perturbed_ckpt(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("int8") / "perturbed"
    shutil.copytree(tiny_llama_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name, t in weights.items():
        if t.std() > 0:
            weights[name] = (t + torch.randn(t.shape, generator=gen) * t.std()).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, tied LM head
def test_float32_matches_transformers_on_the_dequantized_weights(
        make_engine, tiny_llama_dir, tiny_qwen2_dir, arch):
    path = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    eng = make_engine(model_path=str(path), dtype="float32", torchao_config="int8wo")
    got = _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert got == _hf_dequantized_greedy(path, PROMPTS, GREEDY["max_new_tokens"])


def test_tp2_and_a_weight_update_requantize_on_every_rank(make_engine, tiny_llama_dir,
                                                          perturbed_ckpt):
    """Row-parallel shards take the whole rows' maxima, so tp 2 gives tp 1's numbers; a
    weight update re-quantizes the new checkpoint on both ranks."""
    eng = make_engine(model_path=str(tiny_llama_dir), tp_size=2, dtype="float32",
                      torchao_config="int8wo")
    n = GREEDY["max_new_tokens"]
    before = _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert before == _hf_dequantized_greedy(tiny_llama_dir, PROMPTS, n)
    ok, message, _ = eng.update_weights_from_disk(str(perturbed_ckpt))
    assert ok, message
    after = _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert after == _hf_dequantized_greedy(perturbed_ckpt, PROMPTS, n) != before


def _runner(path, **kw) -> ModelRunner:
    args = ServerArgs(model_path=str(path), device="cpu", max_total_tokens=256,
                      disable_cpu_weight_prepack=True, **kw)
    return ModelRunner(args, str(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_dense_weights_are_dropped(tiny_llama_dir, dtype):
    dense, int8 = _runner(tiny_llama_dir, dtype=dtype), _runner(
        tiny_llama_dir, dtype=dtype, torchao_config="int8wo")
    layers = quantizable_layers(int8.model)
    assert len(layers) == 4 * 4 and quantized_layers(int8.model) == layers  # 4 layers x 4
    assert all(m.weight.is_meta and m.qweight.dtype == torch.int8 for m in layers)
    assert int8.model.lm_head.qweight is None and not int8.model.lm_head.weight.is_meta
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    packs = [m.int8_packed for m in layers]
    if dtype == "bfloat16" and quant_linear.fp8_isa() == 2:  # packed, the int8 copy dropped
        assert all(p is not None and p.kind == "w8wo" for p in packs)
        assert all(m.qweight.is_meta for m in layers)
    else:
        assert packs == [None] * len(packs)
    int8_bytes = sum(m.weight.nelement() + m.weight.shape[0] * itemsize if p is None
                     else p.nbytes() + m.weight.shape[0] * itemsize
                     for m, p in zip(layers, packs))
    assert quantized_weight_bytes(int8.model) == int8_bytes
    dense_bytes = sum(m.weight.nelement() * itemsize for m in layers)
    assert int8_bytes < (0.6 if itemsize == 2 else 0.3) * dense_bytes, (int8_bytes, dense_bytes)
    assert dense.weight_bytes - int8.weight_bytes == dense_bytes - int8_bytes


def test_bfloat16_generates_through_the_packed_kernel(make_engine, tiny_llama_dir,
                                                      monkeypatch):
    """Every bf16 product takes the weight-only w8 kernel (decode steps of 1-3 rows, the
    35-token prefill too), each within bf16 x's rounding of float64 ``x @ (q s).T``; a
    weight update packs the new weights. Without AVX512-BF16: torch's packed int8 kernel
    for decode steps, the prefill widened."""
    if quant_linear.fp8_isa() != 2:
        calls = []
        aten = torch.ops.aten._weight_int8pack_mm
        monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm",
                            lambda x, q, s: calls.append(x.shape[0]) or aten(x, q, s))
        eng = make_engine(model_path=str(tiny_llama_dir), dtype="bfloat16",
                          torchao_config="int8wo")
        eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert calls and max(calls) <= 16
        return
    calls = []
    linear = quant_linear.linear

    def spy(x, packed, bias=None):
        y = linear(x, packed, bias)
        w = quant_linear._dequant(packed, 0, packed.n).double()  # q s, exactly
        x2 = x.reshape(-1, packed.k).double()
        want = x2.bfloat16().double() @ w.T + (0 if bias is None else bias.double())
        bound = x2.abs() @ w.abs().T * 2.0**-8 * 1.01 + want.abs() * 2.0**-8 + 1e-6
        assert packed.kind == "w8wo" and x.dtype == y.dtype == torch.bfloat16
        assert ((y.reshape(-1, packed.n).double() - want).abs() <= bound).all()
        calls.append(x2.shape[0])
        return y

    monkeypatch.setattr(quant_linear, "linear", spy)
    eng = make_engine(model_path=str(tiny_llama_dir), dtype="bfloat16",
                      torchao_config="int8wo")
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [len(o["output_ids"]) for o in outs] == [GREEDY["max_new_tokens"]] * len(PROMPTS)
    assert calls and min(calls) <= 3 and max(calls) >= 35  # decode steps and the prefill
    ok, message, _ = eng.update_weights_from_disk(str(tiny_llama_dir))
    assert ok, message
    calls.clear()
    assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == _ids(outs)
    assert calls


@pytest.mark.parametrize("value", ["int8dq", "int4wo-128", "fp8wo", "fp8dq-per_row",
                                   "INT8WO", "int8"])
def test_other_torchao_configs_are_refused(value):
    with pytest.raises(ValueError, match="--torchao-config.*int8wo"):
        ServerArgs(torchao_config=value)


@pytest.mark.parametrize("value", ["rtn", "int8wo", "bitsandbytes", "AWQ", "marlin", ""])
def test_unknown_quantization_methods_are_refused_naming_the_known_ones(value):
    with pytest.raises(ValueError, match="--quantization.*awq, awq_marlin, gptq"):
        ServerArgs(quantization=value)
    with pytest.raises(ValueError, match="--quantization"):
        radixlm.Engine(quantization=value)


@pytest.mark.parametrize("value", ["awq", "gptq_marlin", "fp8", "w8a8_int8", "gguf"])
def test_quantization_with_int8wo_is_refused(value):
    """--torchao-config quantizes a float checkpoint; a quantized one is refused with it."""
    ServerArgs(quantization=value)  # accepted alone
    with pytest.raises(ValueError, match="--torchao-config.*already quantized"):
        ServerArgs(quantization=value, torchao_config="int8wo")


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_args_from_cli(parser.parse_args([])).torchao_config == ""
    args = server_args_from_cli(parser.parse_args(["--torchao-config", "int8wo"]))
    assert args.torchao_config == "int8wo"
    assert server_args_from_cli(parser.parse_args(["--quantization", "awq"])).quantization \
        == "awq"
    with pytest.raises(ValueError, match="--quantization"):
        server_args_from_cli(parser.parse_args(["--quantization", "rtn"]))
    args = server_args_from_cli(parser.parse_args(["--load-format", "gguf"]))
    assert args.load_format == "gguf"
    with pytest.raises(ValueError, match="--load-format"):
        server_args_from_cli(parser.parse_args(["--load-format", "pt"]))
