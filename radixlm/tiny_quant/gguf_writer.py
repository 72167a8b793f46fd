"""A Hugging Face model directory -> a GGUF file, as llama.cpp's ``convert_hf_to_gguf.py``
(and ``llama-quantize``) would write it, for tests and benchmarks.

    write_gguf(model_dir, out_path, qtype="Q4_K")

The metadata keys, tensor names and the two conversions llama.cpp applies (q/k rows
permuted per head for RoPE-"normal" architectures, Gemma's norms stored as ``1 + w``) are
the reader's (``runtime/gguf_file.py``) in reverse; the tokenizer is written as a
byte-level BPE vocabulary (``tokenizer.ggml.model`` "gpt2": tokens, token types, merges)
with the chat template. Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 through
``gguf.quants.quantize``; Q4_K, Q5_K and Q6_K with the quantizers below, written from the
block layouts (``gguf.quants``' dequantizers, ggml-common.h): a min / max fit per sub-block
and 6-bit (8-bit for Q6_K) sub-block scales, simpler than llama.cpp's iterative search, so a
little less accurate, the same format. ``Q4_K_M`` is Q4_K with Q6_K for ``attn_v``,
``ffn_down`` and ``output``, as llama.cpp's mix roughly is. A row that is not whole blocks
of the type falls back to Q8_0 (else F32), as llama.cpp falls back. Norms, biases and
RoPE factors stay F32.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, RopeScalingType, TokenType

from radixlm.runtime.gguf_families import FAMILIES, MISTRAL, MIXTRAL, Family
from radixlm.runtime.gguf_rope import llama3_factors
from radixlm.runtime.model_config import SLIDING, ModelConfig, rope_theta_of

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType
QK_K = 256
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
         "Q4_K_M")

# ---------------------------------------------------------------- k-quant blocks


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _fit_min_max(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (last axis) scale and offset ``m >= 0`` of ``x ~ scale * q - m``,
    ``q`` in ``0..levels``: the min clamped to <= 0, as ggml's ``make_qkx`` does."""
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    return (hi - lo) / levels, -lo


def _super_scales(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """A float16 super-block scale ``d`` per block and the sub-block codes ``0..top`` with
    ``values ~ d * codes``."""
    d = _f16(values.max(axis=-1) / top)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(d32 > 0, np.rint(values / d32), 0)
    return d, np.clip(codes, 0, top).astype(np.uint8)


def _codes(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """``q = round((x + offset) / scale)`` in ``0..top`` per sub-block (scale 0: q = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.rint((x + offset[..., None]) / scale[..., None]), 0)
    return np.clip(q, 0, top).astype(np.uint8)


def _pack_scales_k(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and mins (``Q4_K.get_scale_min``
    reversed): bytes 0-3 scales 0-3 with the top bits of scales 4-7, 4-7 likewise for the
    mins, 8-11 the low nibbles of scales / mins 4-7."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _k_with_min(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """d, dmin (float16), packed scales and the codes [n, 8, 32] of Q4_K / Q5_K blocks."""
    top = (1 << bits) - 1
    x = blocks.reshape(-1, 8, 32).astype(np.float32)
    scale, offset = _fit_min_max(x, top)
    d, sc = _super_scales(scale, 63)
    dmin, mq = _super_scales(offset, 63)
    eff_scale = d.astype(np.float32)[:, None] * sc
    eff_min = dmin.astype(np.float32)[:, None] * mq
    q = _codes(x, eff_scale, eff_min, top)
    return d, dmin, _pack_scales_k(sc, mq), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] codes -> [n, 128] bytes: chunk c holds sub-block 2c in the low nibbles
    and 2c+1 in the high ones."""
    q = q.reshape(-1, 4, 2, 32)
    return ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] Q4_K blocks (d, dmin, scales, qs)."""
    d, dmin, scales, q = _k_with_min(blocks, 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           scales, _nibbles(q)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 176] Q5_K blocks (d, dmin, scales, qh, qs): bit 4 of
    sub-block s's element l is bit s of ``qh[l]``."""
    d, dmin, scales, q = _k_with_min(blocks, 5)
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8, 32]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           scales, qh, _nibbles(q)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] Q6_K blocks (ql, qh, int8 scales, d): sixteen
    sub-blocks of 16 with signed codes -32..31 stored as 0..63."""
    x = blocks.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=-1) / 31
    d, sc = _super_scales(scale, 127)
    eff = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff[..., None] > 0, np.rint(x / eff[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves
    low = q & 15
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.int8).view(np.uint8),
                           d.view(np.uint8).reshape(-1, 2)], axis=1)


_K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``data`` [..., k] float32 as ``qtype`` blocks: uint8 [..., k / block * type_size]
    (float32 / float16 arrays for F32 / F16)."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F32:
        return data
    if qtype == Q.F16:
        return data.astype(np.float16)
    if qtype in _K_QUANTIZERS:
        block, size = GGML_QUANT_SIZES[qtype]
        rows = data.reshape(-1, block)
        out = _K_QUANTIZERS[qtype](rows)
        assert out.shape == (rows.shape[0], size), (out.shape, size)
        return out.reshape(*data.shape[:-1], data.shape[-1] // block * size)
    return quants.quantize(data, qtype)


# ---------------------------------------------------------------- HF names -> GGUF names

# HF architecture -> (GGUF architecture, the reader's family: names and conversions)
_ARCHS: dict[str, tuple[str, Family]] = {
    "LlamaForCausalLM": ("llama", FAMILIES["llama"]),
    "MistralForCausalLM": ("llama", MISTRAL),
    "MixtralForCausalLM": ("llama", MIXTRAL),
    **{f.hf_arch: (arch, f) for arch, f in FAMILIES.items() if arch != "llama"},
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: within each head, the rows of the first half and
    the second half of the head dimension interleaved (HF's rotate-half RoPE -> GGML's
    adjacent pairs)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_name(hf: str, block: dict[str, str], experts: dict[str, str]
               ) -> tuple[str, int | None] | None:
    """(GGUF name, expert index) of an HF checkpoint name; None: not written."""
    if hf in _TOP:
        return _TOP[hf], None
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    layer, rest = parts[2], ".".join(parts[3:])
    inverse = {v: k for k, v in block.items()}
    if rest in inverse:
        return f"blk.{layer}.{inverse[rest]}", None
    for gguf_suffix, pattern in experts.items():
        head, tail = pattern.split("{e}")
        if rest.startswith(head) and rest.endswith(tail):
            index = rest[len(head):len(rest) - len(tail)]
            if index.isdigit():
                return f"blk.{layer}.{gguf_suffix}", int(index)
    return None


# ---------------------------------------------------------------- metadata


def _write_hparams(w: GGUFWriter, c: ModelConfig, arch: str) -> None:
    hf = c.hf_config
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(int(c.head_dim * c.partial_rotary_factor))
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_scaling or {}
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
            if rope.get(key) is not None:
                add(rope[key])
    elif rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(_longrope_attention(rope, c.max_position_embeddings))
    if c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)
        if arch != "llama":  # Mistral: every layer
            w.add_sliding_window_pattern([t == SLIDING for t in c.layer_types])
    if arch in ("gemma2", "gemma3"):
        w.add_attention_scale(float(hf.get("query_pre_attn_scalar", c.head_dim)) ** -0.5)
        if hf.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if arch == "gemma2" and hf.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(rope_theta_of(hf, SLIDING))
    if arch in ("qwen3moe", "llama") and (hf.get("num_experts") or hf.get("num_local_experts")):
        w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        w.add_expert_weights_norm(bool(hf.get("norm_topk_prob", False)))


def _longrope_attention(rope: dict[str, Any], max_pos: int) -> float:
    """LongRoPE's scale of cos / sin, as transformers and llama.cpp's converter compute it."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    scale = max_pos / rope["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) \
        if scale > 1.0 else 1.0


def _rope_tensors(c: ModelConfig) -> dict[str, np.ndarray]:
    """llama.cpp's RoPE factor tensors: Llama 3's divisors, Phi-3's longrope factors."""
    rope = c.rope_scaling or {}
    if rope.get("rope_type") == "llama3":
        return {"rope_freqs.weight": llama3_factors(
            c.head_dim, c.rope_theta, rope["factor"], rope["low_freq_factor"],
            rope["high_freq_factor"], rope["original_max_position_embeddings"]
        ).astype(np.float32)}
    if rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}
    return {}


def _write_tokenizer(w: GGUFWriter, model_dir: Path, c: ModelConfig) -> None:
    """The byte-level BPE vocabulary (tokens by id, types, merges), special ids and the
    chat template, as llama.cpp's ``_set_vocab_gpt2`` writes them."""
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{model_dir}: tokenizer model {model.get('type')!r}; the GGUF writer "
                         "writes byte-level BPE vocabularies only")
    by_id = {i: t for t, i in model["vocab"].items()}
    types = dict.fromkeys(by_id, int(TokenType.NORMAL))
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = int(TokenType.CONTROL if added.get("special")
                                 else TokenType.USER_DEFINED)
    size = max(c.vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([types.get(i, int(TokenType.UNUSED)) for i in range(size)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    cfg = _read_json(model_dir / "tokenizer_config.json")
    ids = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("pad_token", w.add_pad_token_id), ("unk_token", w.add_unk_token_id)):
        name = cfg.get(key)
        name = name.get("content") if isinstance(name, dict) else name
        if name in ids:
            add(ids[name])
    if len(c.eos_token_ids) > 1:  # the chat model's end of turn (generation_config.json)
        w.add_eot_token_id(c.eos_token_ids[1])
    w.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    template = cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str):
        w.add_chat_template(template)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# ---------------------------------------------------------------- tensors and the file


def tensor_type(gguf_name: str, shape: tuple[int, ...], qtype: str) -> GGMLQuantizationType:
    """The GGML type a tensor is written in: F32 for vectors, ``qtype`` for matrices (with
    ``Q4_K_M``'s Q6_K tensors), Q8_0 (else F32) for rows that are not whole blocks."""
    if len(shape) == 1:
        return Q.F32
    if qtype == "Q4_K_M":
        six = gguf_name == "output.weight" or gguf_name.endswith(
            ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight"))
        chosen = Q.Q6_K if six else Q.Q4_K
    else:
        chosen = Q[qtype]
    cols = shape[-1]
    if cols % GGML_QUANT_SIZES[chosen][0]:
        fallback = Q.Q8_0 if chosen != Q.F32 and cols % 32 == 0 else Q.F32
        logger.info("%s: rows of %d are not whole %s blocks, written as %s", gguf_name, cols,
                    chosen.name, fallback.name)
        return fallback
    return chosen


def _hf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    import torch
    from safetensors import safe_open

    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[name] = f.get_tensor(name).to(torch.float32).numpy()
    return out


def gguf_tensors(model_dir: Path, c: ModelConfig) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in HF layout ([out, in]; experts stacked [E, out, in]),
    converted as llama.cpp converts (q/k permuted, Gemma's norms + 1)."""
    arch, family = _ARCHS[c.architectures[0]]
    out: dict[str, np.ndarray] = {}
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for hf, w in _hf_tensors(model_dir).items():
        if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight"
                                                    and c.tie_word_embeddings):
            continue
        mapped = _gguf_name(hf, family.block, family.experts)
        if mapped is None:
            raise ValueError(f"{model_dir}: tensor {hf!r} has no GGUF name for {arch}")
        name, expert = mapped
        if family.permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = permute_qk(w, c.num_attention_heads)
        elif family.permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = permute_qk(w, c.num_key_value_heads)
        if family.norm_shift and name.endswith("norm.weight"):
            w = w + family.norm_shift
        if expert is None:
            out[name] = w
        else:
            stacked.setdefault(name, {})[expert] = w
    for name, parts in stacked.items():
        out[name] = np.stack([parts[e] for e in sorted(parts)])
    out.update(_rope_tensors(c))
    return out


def write_gguf(model_dir: str | Path, out_path: str | Path, qtype: str = "Q8_0") -> Path:
    """Write the HF checkpoint in ``model_dir`` as a GGUF file of ``qtype`` (see TYPES)."""
    if qtype not in TYPES:
        raise ValueError(f"qtype must be one of {TYPES}, got {qtype!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    c = ModelConfig.from_hf(model_dir)
    if c.architectures[0] not in _ARCHS:
        raise ValueError(f"{model_dir}: the GGUF writer does not write {c.architectures[0]} "
                         f"(it writes {', '.join(_ARCHS)})")
    arch = _ARCHS[c.architectures[0]][0]
    w = GGUFWriter(out_path, arch)
    # no general.name: llama.cpp keys token quirks on it ("phi3" wants a "</s>" token)
    _write_hparams(w, c, arch)
    _write_tokenizer(w, model_dir, c)
    for name, data in gguf_tensors(model_dir, c).items():
        t = tensor_type(name, data.shape, qtype)
        blocks = quantize(data, t)
        if t in (Q.F32, Q.F16):
            w.add_tensor(name, blocks)
        else:
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    logger.info("wrote %s (%s, %s) from %s", out_path, arch, qtype, model_dir)
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a Hugging Face model directory as a "
                                                 "GGUF file (our writer).")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--type", default="Q8_0", choices=TYPES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    write_gguf(args.model_dir, args.out, args.type)


if __name__ == "__main__":
    main()
