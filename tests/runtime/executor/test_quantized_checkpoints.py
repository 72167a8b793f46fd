"""Quantized checkpoints served whole: a GGUF file and AWQ / GPTQ / compressed-tensors /
W8A8 / FP8 directories written from the tiny model, each loaded with one argument.

Oracles: a GGUF F32 file gives the float checkpoint's tokens exactly; in every quantized
format each product of a real forward equals the CPU kernel's arithmetic computed in
float64 from the unpacked weight (x rounded to int8 per 32 columns for w4 / w8, to bf16 for
fp8), and the log-probabilities stay within the format's bound of the same checkpoint
dequantized to float32 (``load_quantized(dense=True)``).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

import radixlm
from radixlm.kernels import quant_linear
from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.distributed.layers import Prepackable
from radixlm.runtime.executor.layers.moe import FusedExperts
from radixlm.runtime.executor.quant import loader
from radixlm.tiny_families import make_family_model
from radixlm.tiny_model import ModelShape, make_tiny_model
from radixlm.tiny_quant.gguf_writer import write_gguf
from radixlm.tiny_quant.hf_writer import write_quantized

GREEDY = {"max_new_tokens": 1, "temperature": 0}
SHAPE = ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512)
# format -> the largest mean |log-probability| difference from the file dequantized to
# float32, over 4 random 64-token prompts on a random 2-layer model (measured on an AMD
# Zen 4 host: Q8_0 0.16, Q4_0 0.25, Q4_K 0.24, Q5_K 0.24, Q6_K 0.25, Q4_K_M 0.21, awq 0.24,
# gptq 0.22, w4a16 0.24, w8a8 0.23, fp8 block 0.004 / tensor 0.00003; about 1.5x here).
# w4 / w8 products round x to int8 per 32 columns, as llama.cpp does: about 0.5% of a
# product, which this chaotic random model magnifies.
BOUNDS = {"Q8_0": 0.25, "Q4_0": 0.4, "Q4_K": 0.4, "Q5_K": 0.4, "Q6_K": 0.4, "Q4_K_M": 0.35,
          "awq": 0.4, "gptq": 0.35, "w4a16": 0.4, "w8a8-int8": 0.35, "fp8-block": 0.01,
          "fp8-tensor": 0.001}
# a product against the kernel's arithmetic in float64, relative to its largest output: the
# packed scales and float offsets are fp16 relative to their row's largest (2^-11 each);
# integer zero points (Q4_0, AWQ, GPTQ) are exact (measured on Zen 4: w4 / w8 at most
# 8.7e-4, Q4_K's float offsets; fp8 2.0e-3, its prefill tiles multiplying float32 x where
# _emulated rounds x to bf16)
KERNEL_BOUND = 4e-3
HF_OPTIONS = {"awq": {"group": 32}, "gptq": {"group": 32, "desc_act": True},
              "w4a16": {"group": 32}, "w8a8-int8": {}, "fp8-block": {}, "fp8-tensor": {}}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 2000) for _ in range(64)] for _ in range(4)]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    """The tiny Llama at hidden 256: rows of whole 256-column k-quant super-blocks (the
    tiny model's 128 would leave GGUF's K types to fall back to Q8_0)."""
    return make_tiny_model(tmp_path_factory.mktemp("float256"), shape=SHAPE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, float_dir):
    out = tmp_path_factory.mktemp("quantized")

    def make(fmt: str) -> str:
        if fmt in HF_OPTIONS:
            path = out / fmt
            if not path.exists():
                write_quantized(float_dir, path, fmt, **HF_OPTIONS[fmt])
            return str(path)
        path = out / f"tiny-{fmt}.gguf"
        if not path.exists():
            write_gguf(float_dir, path, fmt)
        return str(path)

    return make


def _logprobs(engine, prompts) -> list[list[float]]:
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=0)
    return [[t[0] for t in o["meta_info"]["input_token_logprobs"][1:]] for o in out]


def _quantized_layers(engine) -> list[Prepackable]:
    model = engine.scheduler.model_runner.model
    return [m for m in model.modules() if isinstance(m, Prepackable) and m.quant is not None]


def test_gguf_f32_file_gives_the_checkpoints_tokens(make_engine, checkpoints, float_dir):
    """The file's own config, tokenizer and (un-permuted) q/k rows: the float model."""
    want = make_engine(model_path=str(float_dir), dtype="float32")
    got = make_engine(model_path=checkpoints("F32"), dtype="float32")
    sp = {"max_new_tokens": 12, "temperature": 0}
    texts = ["The capital of France is", "def fib(n):"]
    assert [o["output_ids"] for o in got.generate(texts, sp)] == \
        [o["output_ids"] for o in want.generate(texts, sp)]
    assert got.tokenizer("hello world").input_ids == want.tokenizer("hello world").input_ids


def _emulated(x: torch.Tensor, qw: QuantWeight, packed: quant_linear.QuantPacked,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU kernel's arithmetic in float64 from the unpacked weight: w4 / w8 multiply x
    rounded to int8 per 32 stored columns (per 256 with coded scales on AVX512-VNNI:
    ``quant_linear.x_block``; d = max|x| / 127, ``nearbyint(x * 127 / max)``)
    and add the offsets (float, or integer zero points ``mins = -z * scales``) times x's
    sum as rounded; fp8 multiplies x rounded to bf16."""
    xs = x if qw.perm is None else x.index_select(-1, qw.perm)
    g = torch.arange(qw.k) // qw.group
    a = qw.codes().double() * qw.scales.double()[:, g]  # stored column order
    if qw.kind == "fp8":
        y = xs.to(torch.bfloat16).double() @ a.T
    else:
        xb = quant_linear.x_block(packed)
        blocks = F.pad(xs.float(), (0, -qw.k % xb)).unflatten(-1, (-1, xb))
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        # a tensor's quotient: torch computes ``127.0 / amax`` as 127 * (1 / amax), off by
        # an ulp, which moves x's codes at ties (quantized embeddings have many)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        q = torch.round(blocks * inv).clamp(-127, 127)
        xq = (q * (amax / 127.0)).double().flatten(-2)[..., : qw.k]
        y = xq @ a.T
        if qw.mins is not None:
            y = y + xq @ qw.mins.double()[:, g].T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def _checked_forward(make_engine, path: str, prompts, monkeypatch):
    """An engine on ``path`` whose every packed product is also computed by ``_emulated``:
    (engine, the prompts' log-probabilities, each product's relative difference)."""
    packs, errors = {}, []
    pack, linear = quant_linear.pack, quant_linear.linear

    def packing(qw: QuantWeight):
        packed = pack(qw)
        packs[id(packed)] = qw
        return packed

    def checked(x, packed, bias=None):
        y = linear(x, packed, bias)
        want = _emulated(x, packs[id(packed)], packed, bias).double()
        errors.append(float((y.double() - want).abs().max() / want.abs().max().clamp(min=1e-30)))
        return y

    with monkeypatch.context() as patch:
        patch.setattr(quant_linear, "pack", packing)
        patch.setattr(quant_linear, "linear", checked)
        engine = make_engine(model_path=path, dtype="float32", disable_radix_cache=True)
        layers = _quantized_layers(engine)
        assert layers, f"{path}: no layer kept its weight quantized"
        assert all(p is not None for m in layers for p in m.quant.packed), \
            f"{path}: a layer's block is not in the CPU kernel's packing"
        got = _logprobs(engine, prompts)
    assert len(errors) >= len(layers), "the products did not go through the packed kernel"
    return engine, got, errors


@pytest.mark.parametrize("fmt", ["Q8_0", "gptq", "fp8-block"])
def test_moe_experts_stay_quantized(make_engine, tmp_path_factory, prompts, monkeypatch, fmt):
    """Qwen3-MoE (a dense layer among sparse ones): every expert's gate_up and down stay
    quantized, each product the kernel's arithmetic; GGUF's stacked experts split per
    expert."""
    src = make_family_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")
    out = tmp_path_factory.mktemp("moe-q")
    if fmt == "Q8_0":
        path = str(write_gguf(src, out / "moe.gguf", fmt))
    else:
        write_quantized(src, out / fmt, fmt, **HF_OPTIONS[fmt])
        path = str(out / fmt)
    engine, _, errors = _checked_forward(make_engine, path, [p[:48] for p in prompts],
                                         monkeypatch)
    experts = [m for m in engine.scheduler.model_runner.model.modules()
               if isinstance(m, FusedExperts)]
    assert experts and all(m.quant_experts is not None and m.gate_up_proj.is_meta
                           for m in experts)
    assert max(errors) <= KERNEL_BOUND, f"{fmt}: {max(errors):.2e}"


@pytest.mark.parametrize("fmt", list(BOUNDS))
def test_quantized_model_follows_the_kernels_arithmetic(make_engine, checkpoints, prompts,
                                                        monkeypatch, fmt):
    """Every product of a forward through the real loader (every block packed) equals the
    kernel's arithmetic in float64 (``_emulated``) on the same activations, within fp16's
    rounding of the packed scales; and the format's error against the file dequantized to
    float32 (int8 or bf16 x included) is within its bound, as a mean over positions: a
    random tiny model is chaotic (its peaked attention turns a 1e-3 change of one product
    into nats at a few positions), so the largest difference says little."""
    path = checkpoints(fmt)
    engine, got, errors = _checked_forward(make_engine, path, prompts, monkeypatch)
    assert max(errors) <= KERNEL_BOUND, \
        f"{fmt}: a product differs from the kernel's arithmetic by {max(errors):.2e}"
    with monkeypatch.context() as patch:
        patch.setattr(loader, "load_quantized",
                      functools.partial(loader.load_quantized, dense=True))
        reference = make_engine(model_path=path, dtype="float32", disable_radix_cache=True)
        assert not _quantized_layers(reference)
        want = _logprobs(reference, prompts)
    diffs = [abs(a - b) for ra, rb in zip(got, want) for a, b in zip(ra, rb)]
    mean = sum(diffs) / len(diffs)
    print(f"{fmt}: products within {max(errors):.1e} of the kernel's arithmetic; "
          f"|d logprob| vs float32 mean {mean:.4f} max {max(diffs):.4f}")
    assert mean <= BOUNDS[fmt], f"{fmt}: mean |d logprob| {mean:.4f} (bound {BOUNDS[fmt]})"


def test_q4_k_m_mixes_formats_in_one_fused_projection(make_engine, checkpoints):
    """q and k in Q4_K, v in Q6_K: the fused qkv keeps two row blocks of two kinds."""
    engine = make_engine(model_path=checkpoints("Q4_K_M"), dtype="float32")
    model = engine.scheduler.model_runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant.kinds == ["w4", "w8"] and qkv.weight.is_meta
    kinds = engine.scheduler.model_runner.quant_kinds
    assert kinds["w4"] > 0 and kinds["w8"] > 0


def test_quantization_flag_must_agree_with_the_checkpoint(checkpoints, float_dir):
    with pytest.raises(ValueError, match="quant_method"):
        radixlm.Engine(model_path=checkpoints("awq"), quantization="gptq")
    with pytest.raises(ValueError, match="no quantization_config"):
        radixlm.Engine(model_path=str(float_dir), quantization="awq")


def test_quantized_checkpoint_is_served_on_one_rank(checkpoints):
    with pytest.raises(ValueError, match="quantized checkpoint.*one rank"):
        radixlm.Engine(model_path=checkpoints("gptq"), tp_size=2)


def test_weight_updates_of_a_quantized_model_are_refused(make_engine, checkpoints, float_dir):
    engine = make_engine(model_path=checkpoints("Q8_0"), dtype="float32")
    ok, message, _ = engine.update_weights_from_disk(str(float_dir))
    assert not ok and "quantized" in message


def test_a_bad_quantized_tensor_is_refused_naming_it(checkpoints, tmp_path):
    """A linear whose packed weight does not match its scales: one error naming it, at
    load, before any weight is copied."""
    src = checkpoints("awq")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # the scales hold groups of 32
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\w+\.\w+_proj\.(scales|qzeros)"):
        radixlm.Engine(model_path=str(bad))


def test_a_gguf_file_serves_chat_with_its_own_template(make_server, checkpoints, float_dir):
    """``radixlm serve --model-path file.gguf``: the chat template and tokenizer come from
    the file, so a chat request's prompt is the float checkpoint's rendering, token for
    token."""
    from transformers import AutoTokenizer

    server = make_server(["--model-path", checkpoints("Q4_K_M"), "--dtype", "float32",
                          "--max-total-tokens", "2048", "--log-level", "warning"], "gguf")
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny-Q4_K_M.gguf", "messages": messages,
                             "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    want = AutoTokenizer.from_pretrained(float_dir).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply.json()["usage"]["prompt_tokens"] == len(want)
    assert reply.json()["model"] == "tiny-Q4_K_M.gguf"


def test_a_hostile_gguf_file_stops_the_server_with_one_line(tmp_path, checkpoints):
    """A GGUF file cut short: ``radixlm serve`` exits 1 naming the file and what is wrong,
    before any child process starts (no traceback)."""
    good = Path(checkpoints("Q8_0")).read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good[: len(good) // 2])
    done = subprocess.run([sys.executable, "-m", "radixlm.cli", "serve", "--model-path",
                           str(bad), "--port", "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert "radixlm serve:" in done.stderr and "cut.gguf" in done.stderr
    assert "Traceback" not in done.stderr
