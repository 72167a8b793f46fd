"""The built-in models: seeded random Llama (or Qwen2) checkpoints in the standard Hugging
Face layout, with a byte-level BPE tokenizer trained here.

No model hub is reachable, so every test (and ``radixlm serve`` without ``--model-path``)
runs on the ``tiny`` preset (hidden 128, 4 layers, vocabulary 2,000, tokenizer trained on
``data/tiny_corpus.txt``). The ``small`` preset has the shape of a small real model
(hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, 32k vocabulary trained on
a generated corpus), so benchmarks see realistic matmul, attention and vocabulary costs.
The weights are random, but scaled so that the logits are decisive: greedy decoding never
hinges on a near-tie that float noise could flip.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TINY_MODEL_VERSION = "v1"  # bump whenever the files this module writes change
CORPUS_PATH = Path(__file__).parent / "data" / "tiny_corpus.txt"
ARCHS = ("llama", "qwen2")

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
VOCAB_SIZE = 2000
CONTEXT_LENGTH = 4096

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)



@dataclass(frozen=True)
class ModelShape:
    """The size of a built-in model (both archs)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    vocab: int = VOCAB_SIZE  # the tokenizer's target size

    def check(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.vocab < 300:
            raise ValueError(f"vocab must be >= 300 (bytes and specials), got {self.vocab}")


PRESETS = {
    "tiny": ModelShape(),
    # about 75M parameters besides the embeddings: a small Llama-like model on a CPU
    "small": ModelShape(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64,
                        intermediate=2048, vocab=32000),
}
# Init scales (at hidden 128; projections shrink as 1/sqrt(width) in larger shapes). A large
# lm_head std spreads the logits (top-1 margin typically > 1) and large projection stds
# keep the residual stream from being just the input embedding (otherwise a tied model
# would mostly predict the token it just read).
EMBED_STD, PROJ_STD, LM_HEAD_STD = 1.0, 0.15, 0.5
SYLLABLES = ("ka", "to", "ri", "mu", "sen", "dra", "vel", "qu", "os", "ith", "pla", "nor",
             "ex", "zu", "bre", "ght", "sch", "ion", "ly", "ment", "y", "a", "e", "o", "i")


def synthetic_corpus(seed: int = 0, words: int = 1_200_000) -> list[str]:
    """Lines of text with a few hundred thousand distinct word forms (enough merges for a
    vocabulary of 128k), punctuation and JSON; deterministic."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 5)))
               for _ in range(300_000)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(lexicon))]
    lines, line = [], []
    for w in rng.choices(lexicon, weights, k=words):
        line.append(w.capitalize() if rng.random() < 0.1 else w)
        if rng.random() < 0.08:
            line.append(rng.choice([",", ".", ":", '"', "{", "}", "[", "]", "-", "'s"]))
        if len(line) > 14:
            lines.append(" ".join(line))
            line = []
    lines += [f'{{"id": {i}, "name": "{rng.choice(lexicon)}", "ok": true}}' for i in range(20000)]
    return lines


def train_tokenizer(corpus_path: Path = CORPUS_PATH, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, no prefix space); deterministic. The tiny corpus alone
    gives about 2,000 tokens; a larger vocabulary also learns from ``synthetic_corpus``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if vocab_size <= VOCAB_SIZE:
        tok.train([str(corpus_path)], trainer)
    else:
        text = corpus_path.read_text(encoding="utf-8").splitlines()
        tok.train_from_iterator(text + synthetic_corpus(), trainer)
    return tok


def _hf_config(arch: str, vocab_size: int, shape: ModelShape) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT_LENGTH,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=shape.layers)
    return config


def _random_weights(arch: str, vocab_size: int, seed: int, shape: ModelShape
                    ) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; generated in a fixed order from one seeded generator."""
    import torch  # here: a server's start reads this module's paths, and torch takes seconds

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = shape.hidden, shape.intermediate
    proj = PROJ_STD * (128 / hidden) ** 0.5  # PROJ_STD at the tiny width

    def normal(*dims: int, std: float) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * std).contiguous()

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab_size, hidden, std=EMBED_STD)
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, out in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(out, hidden, std=proj)
            if arch == "qwen2":
                w[p + f"self_attn.{name}_proj.bias"] = normal(out, std=proj)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q, std=proj)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=proj)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=proj)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=proj)
    w["model.norm.weight"] = torch.ones(hidden)
    if arch == "llama":
        w["lm_head.weight"] = normal(vocab_size, hidden, std=LM_HEAD_STD)
    else:
        # Tied: the embedding doubles as the lm_head; rescale the final norm so the
        # logits get the same spread as the untied model's.
        w["model.norm.weight"] = torch.full((hidden,), LM_HEAD_STD / EMBED_STD)
    return w


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": CONTEXT_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE,
                    trained: Tokenizer | None = None) -> Tokenizer:
    """The built-in tokenizer's files (``trained``, else trained here) and a
    generation_config.json with its EOS ids, in ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = trained or train_tokenizer(vocab_size=vocab_size)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": EOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    eos_ids = [tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END)]
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": eos_ids, "pad_token_id": 0, "do_sample": False},
    )
    return tok


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0,
                    shape: ModelShape | None = None) -> Path:
    """Write a built-in Hugging Face model directory (config, safetensors, tokenizer) to
    ``out_dir``: the tiny shape unless ``shape`` (see PRESETS) is given.

    Same ``arch``, ``seed`` and ``shape`` give byte-identical files.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    shape = shape or PRESETS["tiny"]
    shape.check()
    out = Path(out_dir)
    tok = write_tokenizer(out, shape.vocab)
    vocab_size = tok.get_vocab_size()
    _write_json(out / "config.json", _hf_config(arch, vocab_size, shape))
    from safetensors.torch import save_file

    save_file(
        _random_weights(arch, vocab_size, seed, shape),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    logger.info("wrote a %s model (hidden %d, %d layers, vocab %d) to %s", arch, shape.hidden,
                shape.layers, vocab_size, out)
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")


def default_tiny_model_path(arch: str = "llama", preset: str = "tiny") -> Path:
    """The cached built-in model for ``arch`` and ``preset``, built on first use.

    Built in a temporary directory and renamed into place, so concurrent processes never
    see a half-written model; the loser of a race discards its copy.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    path = cache_dir() / f"{preset}-{arch}-{TINY_MODEL_VERSION}"
    return build_directory_once(path, lambda tmp: make_tiny_model(tmp, arch=arch,
                                                                  shape=PRESETS[preset]))


def build_directory_once(path: Path, write: Callable[[Path], object]) -> Path:
    """``path``, made by ``write(tmp)`` in a temporary sibling directory renamed into place
    unless it exists: concurrent processes never see a half-written directory, and the
    loser of a race discards its copy."""
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, path)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(model_path: str | None, preset: str | None) -> str:
    """``--model-path`` if given, else the built-in ``--preset`` (default tiny)."""
    if model_path and preset:
        raise ValueError("give --model-path or --preset, not both")
    return model_path or str(default_tiny_model_path(preset=preset or "tiny"))


def _add_preset_arg(parser: argparse.ArgumentParser, note: str = "") -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a built-in model's size (default tiny; small: hidden 768, 12 "
                             f"layers, 32k vocabulary){note}")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--preset tiny|small`` and ``--model-path DIR`` (benchmarks; see resolve_model)."""
    _add_preset_arg(parser)
    parser.add_argument("--model-path", default=None, help="a local Hugging Face model")


_SHAPE_FLAGS = {"hidden_size": "hidden", "num_layers": "layers", "num_heads": "heads",
                "num_kv_heads": "kv_heads", "head_dim": "head_dim",
                "intermediate_size": "intermediate", "vocab_size": "vocab"}


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """``--preset tiny|small`` and ``--hidden-size N --num-layers N ...`` (each overrides
    the preset's) for ``radixlm make-tiny-model``; read back by ``shape_from_args``."""
    _add_preset_arg(parser, "; llama / qwen2 only")
    for flag in _SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=None,
                            help="overrides the preset's (llama / qwen2 only)")


def shape_from_args(args: argparse.Namespace) -> ModelShape | None:
    """The shape ``add_shape_args``' flags name; None when none of them was given."""
    changes = {field: getattr(args, flag) for flag, field in _SHAPE_FLAGS.items()
               if getattr(args, flag) is not None}
    if args.preset is None and not changes:
        return None
    return replace(PRESETS[args.preset or "tiny"], **changes)
