"""A GGUF file, checked whole before anything reads it, seen as a Hugging Face checkpoint.

``open_gguf(path)`` reads the container (``gguf_container``: every byte range checked), maps
the architecture onto the family we serve (``gguf_families``: tensor names, config.json) and
checks the model, refusing with a ``GGUFError`` naming the key or tensor:

    the model       an architecture we do not serve (named), metadata that disagrees with
                    the tensors (embedding length, head counts, block count, vocabulary), a
                    tensor missing, unexpected or of another shape

``GGUFModel.tensors`` names every tensor as the checkpoint our models load would
(``model.layers.3.self_attn.q_proj.weight``, a ``TensorInfo``: logical shape, GGML type,
byte range, the conversions to undo). The tensor data is never read here:
``GGUFModel.data(info)`` is a read-only view into the mapped file.

``hf_config()`` is the config.json transformers would write for the family, and
``write_view(dir)`` a directory (config.json, tokenizer, generation_config.json) on which
``ModelConfig.from_hf`` and ``AutoTokenizer.from_pretrained`` work unchanged;
``view_dir_for(path)`` caches it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from radixlm.runtime.gguf_container import GGUFError, RawTensor, read_container
from radixlm.runtime.gguf_families import (
    CONFIG_TENSORS,
    TensorInfo,
    build_hf_config,
    family_of,
    hf_names,
    tensor_info,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the tensors against the config


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the config's model may load (biases and the LM head
    included: ``required_names`` says which must be present)."""
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    inter = cfg["intermediate_size"]
    out = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
           "model.norm.weight": (h,)}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    moe = cfg.get("moe_intermediate_size", inter)
    dense = set(cfg.get("mlp_only_layers") or ())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[f"{p}{name}.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            out[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        out[f"{p}self_attn.o_proj.weight"] = (h, q)
        out[f"{p}self_attn.o_proj.bias"] = (h,)
        out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (hd,)
        out[f"{p}self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        out[f"{p}mlp.gate_up_proj.weight"] = (2 * inter, h)
        out[f"{p}mlp.gate_proj.weight"] = out[f"{p}mlp.up_proj.weight"] = (inter, h)
        out[f"{p}mlp.down_proj.weight"] = (h, inter)
        if cfg["model_type"] == "gpt_oss":
            out.update(_gpt_oss_shapes(p, experts, h, inter, cfg["num_attention_heads"]))
        elif experts and i not in dense:
            mlp = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
            out[f"{p}{mlp}.gate.weight"] = (experts, h)
            for e in range(experts):
                ex = f"{p}{mlp}.experts.{e}."
                for a, b, c in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
                    out[f"{ex}{a}.weight"] = out[f"{ex}{b}.weight"] = (moe, h)
                    out[f"{ex}{c}.weight"] = (h, moe)
    return out


def _gpt_oss_shapes(p: str, experts: int, h: int, inter: int,
                    heads: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss's own tensors of the layer ``p``: sinks, the router and the stacked experts
    (the names ``gguf_families._GPT_OSS`` gives them)."""
    ex = f"{p}mlp.experts."
    return {f"{p}self_attn.sinks": (heads,), f"{p}mlp.router.weight": (experts, h),
            f"{p}mlp.router.bias": (experts,),
            f"{ex}gate_proj": (experts, inter, h), f"{ex}up_proj": (experts, inter, h),
            f"{ex}down_proj": (experts, h, inter), f"{ex}gate_proj_bias": (experts, inter),
            f"{ex}up_proj_bias": (experts, inter), f"{ex}down_proj_bias": (experts, h)}


def _experts_note(cfg: dict[str, Any]) -> str:
    """The expert figures a shape comes from, for a message (empty for a dense model)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return ""
    inter = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    return f", expert_count {experts}, expert_feed_forward_length {inter}"


def _check_tensors(tensors: dict[str, TensorInfo], cfg: dict[str, Any], where: str) -> None:
    """Every tensor of the shape the metadata implies; each layer has its attention and MLP."""
    expected = expected_shapes(cfg)
    for info in tensors.values():
        want = expected.get(info.name)
        if want is None:
            raise GGUFError(f"{where}: unexpected tensor {info.gguf_name!r} ({info.name}) for "
                            f"{cfg['architectures'][0]} with this metadata")
        if info.shape != want:
            raise GGUFError(
                f"{where}: tensor {info.gguf_name!r} has shape {list(info.shape)} but the "
                f"metadata implies {list(want)} (embedding_length {cfg['hidden_size']}, "
                f"head_count {cfg['num_attention_heads']}, head_count_kv "
                f"{cfg['num_key_value_heads']}, key_length {cfg['head_dim']}, "
                f"feed_forward_length {cfg['intermediate_size']}{_experts_note(cfg)})")
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in tensors:
            raise GGUFError(f"{where}: no {name} tensor")


# llama.cpp's llama_model_openai_moe::load_arch_tensors: none optional
GPT_OSS_LAYER = (
    "attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight",
    *(f"attn_{t}.{kind}" for t in ("q", "k", "v", "output") for kind in ("weight", "bias")),
    "ffn_gate_inp.weight", "ffn_gate_inp.bias",
    *(f"ffn_{t}_exps.{kind}" for t in ("gate", "up", "down") for kind in ("weight", "bias")))


def required_per_layer(arch: str, moe_layer: bool) -> tuple[str, ...]:
    """The GGUF tensors (``blk.N.`` suffixes) every layer of ``arch`` must have, as
    llama.cpp's loader requires them."""
    if arch == "gpt-oss":
        return GPT_OSS_LAYER
    attn = ("attn_qkv.weight",) if arch == "phi3" else (
        "attn_q.weight", "attn_k.weight", "attn_v.weight")
    mlp = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
           "ffn_down_exps.weight") if moe_layer else (
        ("ffn_up.weight", "ffn_down.weight") if arch == "phi3"
        else ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    extra = {"qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
             "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
             "qwen3moe": ("attn_q_norm.weight", "attn_k_norm.weight"),
             "gemma2": ("post_attention_norm.weight", "post_ffw_norm.weight"),
             "gemma3": ("post_attention_norm.weight", "post_ffw_norm.weight",
                        "attn_q_norm.weight", "attn_k_norm.weight")}.get(arch, ())
    return ("attn_norm.weight", "ffn_norm.weight", "attn_output.weight", *attn, *mlp, *extra)


def _check_layers(raw: dict[str, RawTensor], arch: str, layers: int, where: str) -> None:
    for i in range(layers):
        moe = f"blk.{i}.ffn_gate_exps.weight" in raw
        for suffix in required_per_layer(arch, moe):
            if f"blk.{i}.{suffix}" not in raw:
                raise GGUFError(f"{where}: layer {i} has no blk.{i}.{suffix} tensor "
                                f"(block_count is {layers})")


# ---------------------------------------------------------------- the model


# tokens llama.cpp's vocabulary treats as the end of generation, by spelling
END_OF_GENERATION = frozenset((
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<EOT>", "[EOT]", "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>"))


def _tokens(meta: dict[str, Any], where: str) -> list[str] | None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list)
                                   and all(isinstance(t, str) for t in tokens)):
        raise GGUFError(f"{where}: tokenizer.ggml.tokens must be an array of strings")
    return tokens


class GGUFModel:
    """A checked GGUF file (``open_gguf``): its metadata, tensors under our checkpoint names
    and the config.json of the family; the file stays mapped until ``close``."""

    def __init__(self, path: Path, meta: dict[str, Any], raw: list[RawTensor],
                 version: int) -> None:
        self.path, self.metadata, self.version = path, meta, version
        self.where = str(path)
        self.gguf_arch, self.family = family_of(meta, raw, self.where)
        self.raw = {t.name: t for t in raw}
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        extra = {name: self._floats(self.raw[name]) for name in CONFIG_TENSORS
                 if name in self.raw}
        self._config = build_hf_config(meta, self.gguf_arch, self.family, self.raw, extra,
                                       self.where)
        tokens = _tokens(meta, self.where)
        if tokens is not None and len(tokens) != self._config["vocab_size"]:
            raise GGUFError(f"{self.where}: tokenizer.ggml.tokens has {len(tokens)} tokens but "
                            f"token_embd.weight has {self._config['vocab_size']} rows")
        self.tensors: dict[str, TensorInfo] = {}
        for t in raw:
            if t.name in CONFIG_TENSORS:
                continue
            for name, expert in hf_names(t, self.family, self._config["num_hidden_layers"],
                                          self.where):
                self.tensors[name] = tensor_info(t, name, expert, self.family, self._config)
        _check_layers(self.raw, self.gguf_arch, self._config["num_hidden_layers"], self.where)
        _check_tensors(self.tensors, self._config, self.where)

    @property
    def architecture(self) -> str:
        """The HF ``architectures`` name we serve the file as (e.g. LlamaForCausalLM)."""
        return self.family.hf_arch

    def hf_config(self) -> dict[str, Any]:
        """config.json as transformers would write it for the family (a copy)."""
        return json.loads(json.dumps(self._config))

    def stop_ids(self) -> list[int]:
        """The tokens that end generation, as llama.cpp's vocabulary collects them: EOS,
        the end-of-turn / end-of-message ids, and the tokens spelled as one (old files
        name no EOT id)."""
        ids = [i for i in (self._config["eos_token_id"],) if i is not None]
        for name in ("eot", "eom"):
            value = self.metadata.get(f"tokenizer.ggml.{name}_token_id")
            if isinstance(value, int) and 0 <= value < self._config["vocab_size"]:
                ids.append(value)
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        ids += [i for i, t in enumerate(tokens) if t in END_OF_GENERATION]
        return list(dict.fromkeys(ids))

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw blocks: a read-only uint8 view into the mapped file."""
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def _floats(self, raw: RawTensor) -> np.ndarray:
        if raw.ggml_type != GGMLQuantizationType.F32 or len(raw.dims) != 1:
            raise GGUFError(f"{self.where}: tensor {raw.name!r} must be a 1-D F32 tensor")
        return np.frombuffer(self._map, dtype="<f4", count=raw.dims[0], offset=raw.offset).copy()

    def close(self) -> None:
        """Close the file; the mapping goes with the last view ``data`` handed out."""
        try:
            self._map.close()
        except BufferError:  # views still alive: unmapped when they are collected
            pass
        self._file.close()

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_view(self, out: str | os.PathLike) -> Path:
        """config.json (with ``quantization_config`` naming this file), the tokenizer built
        from the file's metadata and generation_config.json, in ``out`` (created)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.hf_config()
        cfg["quantization_config"] = {"quant_method": "gguf",
                                      "gguf_file": str(self.path.resolve())}
        _write_json(out / "config.json", cfg)
        _write_json(out / "generation_config.json",
                    {"bos_token_id": cfg["bos_token_id"], "eos_token_id": self.stop_ids(),
                     "pad_token_id": cfg["pad_token_id"]})
        write_tokenizer(self, out)
        return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(model: GGUFModel, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template, BOS / EOS) from the file's
    ``tokenizer.*`` metadata, built by transformers' GGUF tokenizer converter from the
    vocabulary's own type (``tokenizer.ggml.model``, ``.pre``), whatever the architecture."""
    if "tokenizer.ggml.tokens" not in model.metadata:
        raise GGUFError(f"{model.where}: no tokenizer in the file (tokenizer.ggml.tokens)")
    # seconds to import: only when a view is built
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, vocab, settings = get_gguf_tokenizer(str(model.path))
        backend, extra = convert_gguf_tokenizer(arch, vocab)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**settings, **extra})
    except Exception as e:  # noqa: BLE001 - whatever the file's vocabulary breaks, by name
        raise GGUFError(f"{model.where}: its tokenizer (tokenizer.ggml.model "
                        f"{model.metadata.get('tokenizer.ggml.model')!r}) cannot be built: "
                        f"{e}") from None
    tok.save_pretrained(str(out))
    # one place for the template and the limits: tokenizer_config.json, as hub models have it
    (out / "chat_template.jinja").unlink(missing_ok=True)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    template = model.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        cfg["chat_template"] = template
    cfg["model_max_length"] = model.hf_config()["max_position_embeddings"]
    _write_json(path, cfg)


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """The GGUF file at ``path``, checked whole (see the module docstring); GGUFError naming
    the key or tensor otherwise."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    meta, raw, version = read_container(path)
    return GGUFModel(path, meta, raw, version)


VIEW_VERSION = 2  # bump whenever write_view writes something else: old views are not reused


def view_dir_for(path: str | os.PathLike) -> Path:
    """The cached view directory of the GGUF file at ``path`` (``write_view``), under
    $RADIXLM_CACHE_DIR or ~/.cache/radixlm: ``gguf/<digest of VIEW_VERSION, the path, size
    and mtime>``,
    private (0700), written in a temporary directory renamed into place, reused after."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{VIEW_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
                         ).hexdigest()[:16]
    root = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")
    view = root / "gguf" / key
    if (view / "config.json").is_file():
        return view
    view.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=view.parent))  # 0700
    try:
        with open_gguf(path) as model:
            model.write_view(tmp)
        os.rename(tmp, view)
    except OSError:
        if not (view / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return view
