"""What a model directory must hold, checked before anything is parsed, loaded or spawned:
``config.json`` naming an architecture radixlm serves, safetensors weights, and a tokenizer.

A directory that fails gets one ``ModelDirError`` naming the missing file or the refused
architecture (with the list of served ones), instead of a ``KeyError`` deep in config
parsing or transformers' "install sentencepiece" from every process that loads the
tokenizer. Plain json and paths only: ``radixlm serve`` checks before its seconds of imports
and before its children start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# config.json ``architectures`` names radixlm serves; ``executor/models``' MODEL_CLASSES has
# a class for each (it asserts so at import). Of the hybrid attention / state-space models,
# Qwen3-Next and Qwen3.5 (dense and MoE), the Mamba2 hybrids (Nemotron-H, Granite 4,
# Falcon-H1, Bamba) and Jamba (Mamba v1 layers) are served; MLA (DeepSeek-V2/V3) is not.
SERVED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM",
    "GraniteForCausalLM", "GptOssForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM", "BambaForCausalLM", "JambaForCausalLM",
    # base models (AutoModel checkpoints, as embedding models are saved), --is-embedding
    "LlamaModel", "MistralModel", "Qwen2Model",
)
# a config.json that names no architectures (a config saved on its own, not with a model)
# is read by its model_type, as transformers' AutoModelForCausalLM would map it
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM", "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
    "bamba": "BambaForCausalLM", "jamba": "JambaForCausalLM",
}
# architectures refused with a reason beyond "not served"
NOT_SERVED_WHY: dict[str, str] = {}
# what AutoTokenizer builds a tokenizer from: a tokenizers serialization, a sentencepiece
# or tiktoken model, a BPE or WordPiece vocabulary
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken",
                   "tekken.json")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")


class ModelDirError(ValueError):
    """A model directory radixlm cannot serve; the message names the file or architecture."""


def check_model_dir(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> None:
    """Refuse ``model_dir`` (tokenizer from ``tokenizer_dir``, default ``model_dir``) unless
    it holds a readable config.json of a served architecture, safetensors weights and
    tokenizer files: ``ModelDirError`` naming the first thing missing."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    served_architecture(config, model_dir / "config.json")
    if not _has_any(model_dir, WEIGHT_FILES) and not _gguf_weights(config):
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        raise ModelDirError(
            f"no *.safetensors weights in {model_dir}"
            + (f" (radixlm reads safetensors only; found {', '.join(bins[:3])})" if bins else ""))
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    if not tokenizer_dir.is_dir():
        raise ModelDirError(f"tokenizer path {str(tokenizer_dir)!r} is not a local directory")
    if not _has_any(tokenizer_dir, TOKENIZER_FILES):
        raise ModelDirError(
            f"no tokenizer files in {tokenizer_dir}: expected tokenizer.json (or a "
            "sentencepiece tokenizer.model, vocab.json + merges.txt, vocab.txt); "
            "--tokenizer-path names a tokenizer kept elsewhere")


def _gguf_weights(config: dict[str, Any]) -> bool:
    """Whether config.json says the weights are a GGUF file (a ``gguf_file.view_dir_for``)
    that exists."""
    quant = config.get("quantization_config")
    return (isinstance(quant, dict) and quant.get("quant_method") == "gguf"
            and isinstance(quant.get("gguf_file"), str) and Path(quant["gguf_file"]).is_file())


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """``model_dir``'s config.json as a dict; ``ModelDirError`` when missing or not JSON."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelDirError(f"no config.json in model directory {model_dir} (a Hugging Face "
                            "checkpoint: config.json, *.safetensors and the tokenizer files)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def served_architecture(hf: dict[str, Any], where: str | Path = "config.json") -> str:
    """The first name in ``hf["architectures"]`` that radixlm serves (a config without
    architectures: its model_type's causal LM); else ``ModelDirError``
    naming the checkpoint's architectures (or its model_type when it names none) and listing
    the served ones. Checked before any other field is read: other architectures' configs
    lack fields ours need (GPT-2 has no ``num_attention_heads``)."""
    archs = hf.get("architectures") or []
    if not archs and hf.get("model_type") in ARCHITECTURE_OF_MODEL_TYPE:
        return ARCHITECTURE_OF_MODEL_TYPE[hf["model_type"]]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelDirError(f"{where}: architectures must be a list of names, got {archs!r}")
    for name in archs:
        if name in SERVED_ARCHITECTURES:
            return name
    why = "".join(f" ({name}: {NOT_SERVED_WHY[name]})" for name in archs
                  if name in NOT_SERVED_WHY)
    raise ModelDirError(f"{where}: radixlm does not serve {_named(archs, hf)}{why}; it serves "
                        f"{', '.join(SERVED_ARCHITECTURES)}")


def _named(archs: Sequence[str], hf: dict[str, Any]) -> str:
    if archs:
        return " / ".join(archs)
    return f"a config.json without architectures (model_type {hf.get('model_type')!r})"


def _has_any(directory: Path, patterns: Sequence[str]) -> bool:
    return any(p.is_file() for pattern in patterns for p in directory.glob(pattern))
