"""The built-in tiny model: a seeded random Llama (or Qwen2) checkpoint in the standard
Hugging Face layout, with a byte-level BPE tokenizer trained on ``data/tiny_corpus.txt``.

No model hub is reachable, so every test (and ``radixlm serve`` without ``--model-path``)
runs on this model. The weights are random, but scaled so that the logits are decisive:
greedy decoding never hinges on a near-tie that float noise could flip.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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

# Shape of the network (both archs).
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 4, 4, 2, 32, 256
# Init scales. A large lm_head std spreads the logits (top-1 margin typically > 1) and
# large projection stds keep the residual stream from being just the input embedding
# (otherwise a tied model would mostly predict the token it just read).
EMBED_STD, PROJ_STD, LM_HEAD_STD = 1.0, 0.15, 0.5


def train_tokenizer(corpus_path: Path = CORPUS_PATH, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, no prefix space) over the corpus; deterministic."""
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
    tok.train([str(corpus_path)], trainer)
    return tok


def _hf_config(arch: str, vocab_size: int) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
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
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=LAYERS)
    return config


def _random_weights(arch: str, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; generated in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab_size, HIDDEN, std=EMBED_STD)
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        for name, out in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(out, HIDDEN, std=PROJ_STD)
            if arch == "qwen2":
                w[p + f"self_attn.{name}_proj.bias"] = normal(out, std=PROJ_STD)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, q, std=PROJ_STD)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN, std=PROJ_STD)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN, std=PROJ_STD)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE, std=PROJ_STD)
    w["model.norm.weight"] = torch.ones(HIDDEN)
    if arch == "llama":
        w["lm_head.weight"] = normal(vocab_size, HIDDEN, std=LM_HEAD_STD)
    else:
        # Tied: the embedding doubles as the lm_head; rescale the final norm so the
        # logits get the same spread as the untied model's.
        w["model.norm.weight"] = torch.full((HIDDEN,), LM_HEAD_STD / EMBED_STD)
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


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny Hugging Face model directory (config, safetensors, tokenizer) to ``out_dir``.

    Same ``arch`` and ``seed`` give byte-identical files.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    vocab_size = tok.get_vocab_size()
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
    _write_json(out / "config.json", _hf_config(arch, vocab_size))
    eos_ids = [tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END)]
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": eos_ids, "pad_token_id": 0, "do_sample": False},
    )
    save_file(
        _random_weights(arch, vocab_size, seed),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    logger.info("wrote tiny %s model (vocab %d) to %s", arch, vocab_size, out)
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")


def default_tiny_model_path(arch: str = "llama") -> Path:
    """The cached tiny model for ``arch``, built on first use.

    Built in a temporary directory and renamed into place, so concurrent processes never
    see a half-written model; the loser of a race discards its copy.
    """
    path = cache_dir() / f"tiny-{arch}-{TINY_MODEL_VERSION}"
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        make_tiny_model(tmp, arch=arch)
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, path)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main_make_tiny_model(argv: list[str] | None = None) -> int:
    """``radixlm make-tiny-model DIR [--arch llama|qwen2] [--seed N]``."""
    parser = argparse.ArgumentParser(
        prog="radixlm make-tiny-model", description="Write the built-in tiny model to DIR."
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    return 0
