"""gpt-oss GGUF files: the experts in MXFP4 blocks (ggml's ``block_mxfp4``), gate and up
stacked apart, served token-exact.

Files: a tiny gpt-oss checkpoint whose experts are packed to MXFP4 (``mxfp4.quantize``, as
the released checkpoints hold them), written as GGUF twice: by hand here (gguf's
``GGUFWriter``, the MXFP4 bytes laid out from ggml's spec: one E8M0 byte, then 16 bytes
whose low nibbles are elements 0-15 and high nibbles 16-31), which CI can always run, and
by llama.cpp's own ``convert_hf_to_gguf.py`` when its venv is here.

Oracles: transformers' GptOssForCausalLM in float32 on the checkpoint with the same MXFP4
experts dequantized (exact greedy tokens, the packed experts' products exact:
``exact_products``); the experts read back equal to ``mxfp4``'s dequantization bit for
bit; llama.cpp's own greedy tokens on its file, where its logits are decisive; hostile
files refused naming the tensor or key.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from radixlm.kernels import quant_linear
from radixlm.runtime.executor.models import mxfp4
from radixlm.runtime.executor.quant.gguf_weights import read_tensor
from radixlm.runtime.gguf_container import GGUFError
from radixlm.runtime.gguf_file import open_gguf
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_families import make_family_model
from radixlm.tiny_quant.gguf_writer import _write_tokenizer

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from llamacpp_side import report  # noqa: E402
from llamacpp_side.files import default_tools  # noqa: E402
from llamacpp_side.workers import run_llama_worker  # noqa: E402

TOOLS = default_tools()
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 2000) for _ in range(n)] for n in (7, 19, 40)]
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("gpt_oss"))


def make_checkpoints(root: Path) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, float checkpoint of what its experts hold) of the tiny gpt-oss
    family (4 layers, hidden 128, 8 experts of 64, top 2), with llama.cpp's SwiGLU limit
    of 7 (its graph has no other; the GGUF file no key for it)."""
    src = make_family_model(root / "src", "gpt_oss")
    cfg = json.loads((src / "config.json").read_text())
    cfg["swiglu_limit"] = 7.0
    (src / "config.json").write_text(json.dumps(cfg))
    mx, deq = shutil.copytree(src, root / "mx"), shutil.copytree(src, root / "deq")
    packed, dense = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(EXPERTS):  # [E, in, out] -> ours [E, out, in], packed along in
            blocks, scales = mxfp4.quantize(t.transpose(1, 2))
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dense[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2).contiguous()
        else:
            packed[name] = dense[name] = t
    save_file(packed, str(mx / "model.safetensors"))
    save_file(dense, str(deq / "model.safetensors"))
    (mx / "config.json").write_text(json.dumps({**cfg, "quantization_config":
                                                {"quant_method": "mxfp4"}}))
    return mx, deq


# ---------------------------------------------------------------- a GGUF file by hand


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Our MXFP4 pair (``[..., G, 16]`` codes, element 2i in the low nibble; ``[..., G]``
    scales) as ggml's ``block_mxfp4`` bytes ``[..., G * 17]``: the E8M0 scale byte, then
    byte j holding element j (low nibble) and element j + 16 (high nibble)."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales[..., None], qs), dim=-1)  # [..., G, 17]
    return out.flatten(-2).numpy()


def _ggml_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., G, 17]`` block_mxfp4 bytes back to float32 ``[..., G * 32]``, through our
    pair's layout (``ggml_mxfp4`` inverted)."""
    qs = blocks[..., 1:]
    codes = torch.cat((qs & 15, qs >> 4), dim=-1)  # [..., G, 32] in element order
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return mxfp4.dequantize(pairs, blocks[..., 0])


def gguf_tensors(mx: Path, layers: int) -> dict[str, tuple[np.ndarray, bool]]:
    """GGUF name -> (data, whether raw MXFP4 bytes) of the MXFP4 checkpoint, named and split
    as llama.cpp's converter does: the interleaved gate_up's even rows are the gate."""
    t = load_file(str(mx / "model.safetensors"))
    out = {"token_embd.weight": (t["model.embed_tokens.weight"], False),
           "output_norm.weight": (t["model.norm.weight"], False),
           "output.weight": (t["lm_head.weight"], False)}
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a, m, ex = p + "self_attn.", p + "mlp.", p + "mlp.experts."
        names = {"attn_norm.weight": p + "input_layernorm.weight",
                 "post_attention_norm.weight": p + "post_attention_layernorm.weight",
                 "attn_sinks.weight": a + "sinks", "ffn_gate_inp.weight": m + "router.weight",
                 "ffn_gate_inp.bias": m + "router.bias",
                 "ffn_down_exps.bias": ex + "down_proj_bias"}
        for x, y in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            names[f"attn_{x}.weight"], names[f"attn_{x}.bias"] = (
                a + f"{y}_proj.weight", a + f"{y}_proj.bias")
        out.update({b + k: (t[v], False) for k, v in names.items()})
        bias = t[ex + "gate_up_proj_bias"]
        out[b + "ffn_gate_exps.bias"], out[b + "ffn_up_exps.bias"] = (bias[:, 0::2], False), (
            bias[:, 1::2], False)
        gu_b, gu_s = t[ex + "gate_up_proj_blocks"], t[ex + "gate_up_proj_scales"]
        out[b + "ffn_gate_exps.weight"] = (ggml_mxfp4(gu_b[:, 0::2], gu_s[:, 0::2]), True)
        out[b + "ffn_up_exps.weight"] = (ggml_mxfp4(gu_b[:, 1::2], gu_s[:, 1::2]), True)
        out[b + "ffn_down_exps.weight"] = (
            ggml_mxfp4(t[ex + "down_proj_blocks"], t[ex + "down_proj_scales"]), True)
    return out


def llamacpp_keys(c: ModelConfig) -> dict[str, int | float | str]:
    """The ``gpt-oss.*`` keys llama.cpp's converter writes for the checkpoint."""
    hf, rope = c.hf_config, c.rope_scaling
    return {"block_count": c.num_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads,
            "attention.head_count_kv": c.num_key_value_heads,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
            "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
            "attention.sliding_window": c.sliding_window, "rope.freq_base": c.rope_theta,
            "rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": rope["beta_fast"],
            "rope.scaling.yarn_beta_slow": rope["beta_slow"],
            "expert_count": hf["num_local_experts"],
            "expert_used_count": hf["num_experts_per_tok"],
            "expert_feed_forward_length": c.intermediate_size}


def write_gpt_oss_gguf(mx: Path, out: Path, meta: dict | None = None, drop: tuple = (),
                       cut: dict[str, int] | None = None, dense_experts: bool = False) -> Path:
    """``mx`` as a gpt-oss GGUF file with llama.cpp's keys and tensors (F32 but for the
    MXFP4 experts; ``dense_experts``: F32 too, their dequantized values, as the converter
    writes a checkpoint not in MXFP4); ``meta`` overrides ``gpt-oss.*`` keys (None: leave
    out), ``drop`` leaves tensors out and ``cut`` keeps the first n blocks of the named
    MXFP4 tensors' rows."""
    c = ModelConfig.from_hf(mx)
    w = GGUFWriter(out, "gpt-oss")
    for key, value in {**llamacpp_keys(c), **(meta or {})}.items():
        add = {int: w.add_uint32, float: w.add_float32, str: w.add_string}.get(type(value))
        if add is not None:
            add(f"gpt-oss.{key}", value)
    _write_tokenizer(w, mx, c)
    for name, (data, raw) in gguf_tensors(mx, c.num_layers).items():
        if name in drop:
            continue
        if not raw:
            w.add_tensor(name, data.to(torch.float32).numpy())
            continue
        if dense_experts:
            blocks = torch.from_numpy(data.reshape(*data.shape[:-1], -1, 17))
            w.add_tensor(name, _ggml_dequantize(blocks).numpy())
            continue
        keep = (cut or {}).get(name)
        if keep is not None:
            data = np.ascontiguousarray(data[..., :keep * 17])
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---------------------------------------------------------------- oracles


@pytest.fixture(scope="module")
def want_tokens(checkpoints) -> list[list[int]]:
    return hf_tokens(checkpoints[1])


def hf_tokens(deq: Path) -> list[list[int]]:
    """transformers' greedy tokens on the dequantized checkpoint, float32."""
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY["max_new_tokens"],
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
                .tolist() for p in PROMPTS]


def exact_products(monkeypatch) -> None:
    """Quantized products through the packed weights dequantized tile by tile to x's dtype
    (``quant_linear``'s path past ``dequant_rows``), not the kernel's rounding of x to int8
    per 32 columns: the tokens of the weights themselves, comparable with transformers'
    float32 exactly. The kernel's own arithmetic: test_gpt_oss_packed_experts.py."""
    monkeypatch.setattr(quant_linear, "dequant_rows", lambda kind: 0)


def _served(make_engine, path: Path, monkeypatch) -> list[list[int]]:
    exact_products(monkeypatch)
    eng = make_engine(model_path=str(path), dtype="float32")
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def hand_file(checkpoints, tmp_path_factory) -> Path:
    return write_gpt_oss_gguf(checkpoints[0], tmp_path_factory.mktemp("hand") / "m.gguf")


def test_hand_written_file_reads_as_the_checkpoint(hand_file, checkpoints):
    """The view's config is gpt-oss's (sliding first, llama.cpp's SwiGLU constants, yarn
    without truncation) and every expert reads back exactly as ``mxfp4`` dequantizes the
    checkpoint's blocks: gate and up from the even and odd rows of gate_up."""
    mx, deq = checkpoints
    dense = load_file(str(deq / "model.safetensors"))
    with open_gguf(hand_file) as model:
        cfg = model.hf_config()
        assert (cfg["architectures"], cfg["num_local_experts"], cfg["intermediate_size"],
                cfg["swiglu_limit"], cfg["sliding_window"]) == (
            ["GptOssForCausalLM"], 8, 64, 7.0, 24)
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
        assert cfg["rope_scaling"]["truncate"] is False
        info = model.tensors["model.layers.1.mlp.experts.gate_proj"]
        assert (info.type_name, info.shape) == ("MXFP4", (8, 64, 128))
        for layer in (0, 3):
            p = f"model.layers.{layer}.mlp.experts."
            gate_up = dense[p + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H], interleaved
            assert torch.equal(_stacked(model, p + "gate_proj"), gate_up[:, 0::2])
            assert torch.equal(_stacked(model, p + "up_proj"), gate_up[:, 1::2])
            assert torch.equal(_stacked(model, p + "down_proj"),
                               dense[p + "down_proj"].transpose(1, 2))


def _stacked(model, name: str) -> torch.Tensor:
    """A stacked MXFP4 expert tensor as read (one quantized weight per expert), in float."""
    experts = read_tensor(model, name)
    assert isinstance(experts, list) and all(qw.kind == "w8" for qw in experts)
    return torch.stack([qw.dequantize() for qw in experts])


def test_hand_written_file_serves_transformers_tokens(hand_file, want_tokens, make_engine,
                                                      monkeypatch):
    assert _served(make_engine, hand_file, monkeypatch) == want_tokens


def test_float_experts_serve_the_same_tokens(checkpoints, want_tokens, make_engine, tmp_path,
                                            monkeypatch):
    """Experts in another GGML type (F32 here: llama.cpp's converter writes the outtype when
    the checkpoint is not MXFP4) take the same path: the same values, the same tokens."""
    path = write_gpt_oss_gguf(checkpoints[0], tmp_path / "f32.gguf", dense_experts=True)
    with open_gguf(path) as model:
        assert model.tensors["model.layers.0.mlp.experts.up_proj"].type_name == "F32"
    assert _served(make_engine, path, monkeypatch) == want_tokens


# ---------------------------------------------------------------- llama.cpp's own file

LLAMA_CPP = TOOLS.llama_cpp_src / "convert_hf_to_gguf.py"
# llama.cpp computes another model in two small ways: its MXFP4 dot products take the
# activations rounded to 8 bits per block of 32 (q8_0), and it truncates the yarn ramp's ends
# (gpt-oss's definition, and transformers', does not). Measured on these prompts: its last
# logits differ from transformers' by 0.4 to 9 (std 5.7) as top-2 routing flips between
# near-tied experts. Where its top-2 margin exceeds the bound, the tokens must still agree.
MARGIN_BOUND = 2.5


@pytest.fixture(scope="module")
def llamacpp_file(checkpoints, tmp_path_factory) -> Path:
    if not TOOLS.python.exists() or not LLAMA_CPP.is_file():
        pytest.skip(f"llama.cpp's venv ({TOOLS.venv}) or its converter ({LLAMA_CPP}) is "
                    "not here")
    out = tmp_path_factory.mktemp("llamacpp") / "m.gguf"
    env = {**os.environ, "PYTHONPATH": str(BENCH_DIR)}
    proc = subprocess.run([sys.executable, "-m", "llamacpp_side.convert",
                           str(TOOLS.llama_cpp_src), str(checkpoints[0]), str(out), "f32"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    return out


def test_llamacpp_file_has_the_hand_written_bytes(llamacpp_file, hand_file):
    """llama.cpp's converter lays the experts' MXFP4 blocks out byte for byte as the spec
    above does (so the hand-written file CI reads is the layout users download)."""
    with open_gguf(llamacpp_file) as theirs, open_gguf(hand_file) as ours:
        assert theirs.metadata["general.file_type"] == 38  # MOSTLY_MXFP4_MOE
        for name in ("gate_proj", "up_proj", "down_proj"):
            a = theirs.tensors[f"model.layers.2.mlp.experts.{name}"]
            b = ours.tensors[f"model.layers.2.mlp.experts.{name}"]
            assert a.type_name == "MXFP4" and (a.shape, a.nbytes) == (b.shape, b.nbytes)
            assert np.array_equal(theirs.data(a), ours.data(b))


def test_llamacpp_file_serves_transformers_tokens(llamacpp_file, want_tokens, make_engine,
                                                   monkeypatch):
    assert _served(make_engine, llamacpp_file, monkeypatch) == want_tokens


def test_llamacpp_agrees_where_decisive(llamacpp_file, want_tokens, tmp_path):
    """llama.cpp's greedy tokens on its file against ours (= transformers'): equal up to
    each prompt's first difference, which may only come where llama.cpp's margin is small."""
    spec = {"mode": "greedy", "model": str(llamacpp_file), "threads": 2, "prompts": PROMPTS,
            "tokens": GREEDY["max_new_tokens"], "near": MARGIN_BOUND}
    theirs = run_llama_worker(TOOLS, spec, tmp_path / "log")
    equal, problems = report.greedy_agreement(theirs, want_tokens, MARGIN_BOUND)
    assert not problems, problems
    decisive = sum(m > MARGIN_BOUND for ids, ms, mine in zip(
        theirs["output_ids"], theirs["margins"], want_tokens)
        for m, _ in zip(ms, _common_prefix(ids, mine)))
    assert equal >= 5 and decisive >= 3, f"{equal} tokens equal, {decisive} decisive: the " \
        "check says little"


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


# ---------------------------------------------------------------- hostile files


@pytest.mark.parametrize("kwargs, words", [
    ({"cut": {"blk.1.ffn_up_exps.weight": 2}}, ["blk.1.ffn_up_exps.weight", "[8, 64, 64]",
                                                  "[8, 64, 128]"]),
    ({"meta": {"expert_feed_forward_length": 96}}, ["blk.0.ffn_gate_exps", "[8, 96]"]),
    ({"meta": {"expert_count": 4}}, ["blk.0.ffn_gate_inp.weight"]),
    ({"meta": {"expert_count": None}}, ["gpt-oss.expert_count is missing"]),
    ({"meta": {"expert_used_count": 9}}, ["gpt-oss.expert_used_count 9"]),
    ({"drop": ("blk.2.attn_sinks.weight",)}, ["blk.2.attn_sinks.weight"]),
    ({"drop": ("blk.1.ffn_down_exps.bias",)}, ["blk.1.ffn_down_exps.bias"]),
])
def test_disagreeing_file_is_refused_by_name(checkpoints, tmp_path, kwargs, words):
    path = write_gpt_oss_gguf(checkpoints[0], tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(GGUFError) as err:
        open_gguf(path).close()
    assert all(w in str(err.value) for w in words), str(err.value)


def test_missing_sliding_window_is_refused(checkpoints, tmp_path):
    path = write_gpt_oss_gguf(checkpoints[0], tmp_path / "bad.gguf",
                              meta={"attention.sliding_window": None})
    with pytest.raises(GGUFError, match="gpt-oss.attention.sliding_window is missing"):
        open_gguf(path).close()


def test_truncated_mxfp4_data_is_refused_by_name(hand_file, tmp_path):
    """Cut inside the last expert tensor's blocks: refused naming it, nothing read."""
    with open_gguf(hand_file) as model:
        last = max((t for t in model.raw.values()), key=lambda t: t.offset)
        assert last.ggml_type == GGMLQuantizationType.MXFP4, last.name
        cut = last.offset + last.nbytes // 2 + 5  # mid-block
    path = tmp_path / "cut.gguf"
    path.write_bytes(hand_file.read_bytes()[:cut])
    with pytest.raises(GGUFError, match=f"{last.name}.*runs past the end of the file"):
        open_gguf(path).close()
