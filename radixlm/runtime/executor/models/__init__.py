"""Model registry (HF ``architectures`` name -> class) and ``load_model``.

A family is one short file composing ``decoder.py`` (itself built from ``../layers``): a
``DecoderForCausalLM`` subclass whose ``spec_for`` says what differs from Llama. Adding
one: see docs/design.md ("How to add a model family").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.distributed.parallel_state import TpGroup, building_with
from radixlm.runtime.executor.models.bamba import BambaForCausalLM
from radixlm.runtime.executor.models.decoder import DecoderForCausalLM
from radixlm.runtime.executor.models.falcon_h1 import FalconH1ForCausalLM
from radixlm.runtime.executor.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    GemmaForCausalLM,
)
from radixlm.runtime.executor.models.gpt_oss import GptOssForCausalLM
from radixlm.runtime.executor.models.granite import GraniteForCausalLM
from radixlm.runtime.executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from radixlm.runtime.executor.models.jamba import JambaForCausalLM
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.executor.models.mistral import MinistralForCausalLM, MistralForCausalLM
from radixlm.runtime.executor.models.mixtral import MixtralForCausalLM
from radixlm.runtime.executor.models.nemotron_h import NemotronHForCausalLM
from radixlm.runtime.executor.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from radixlm.runtime.executor.models.phi3 import Phi3ForCausalLM
from radixlm.runtime.executor.models.qwen2 import Qwen2ForCausalLM
from radixlm.runtime.executor.models.qwen3 import Qwen3ForCausalLM
from radixlm.runtime.executor.models.qwen3_moe import Qwen3MoeForCausalLM
from radixlm.runtime.executor.models.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)
from radixlm.runtime.executor.models.smollm3 import SmolLM3ForCausalLM
from radixlm.runtime.executor.models.weights import load_weights
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.model_dir import SERVED_ARCHITECTURES, served_architecture

logger = logging.getLogger(__name__)

__all__ = ["MODEL_CLASSES", "get_model_class", "build_model", "load_model", "masked_layers",
           "decode_windows", "state_specs", "LlamaForCausalLM", "Qwen2ForCausalLM"]

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # text-only: the vision tower is not loaded
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # hybrids: Gated DeltaNet layers (their state in the state pool) beside attention
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    # text-only: the vision tower is not loaded
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    # Mamba2 hybrids: Mamba2 layers (their state in the state pool) beside attention
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    # Mamba (v1) layers beside attention
    "JambaForCausalLM": JambaForCausalLM,
    # base models (transformers' AutoModel checkpoints, as embedding models are saved:
    # no LM head), served with --is-embedding
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
}


# model_dir.py refuses every other architecture before a config is parsed or a process starts
assert set(MODEL_CLASSES) == set(SERVED_ARCHITECTURES), (
    sorted(set(MODEL_CLASSES) ^ set(SERVED_ARCHITECTURES)))


def get_model_class(architectures: Sequence[str]) -> type[DecoderForCausalLM]:
    """The class for the first served name in config.json's ``architectures``
    (``ModelDirError`` naming them and the served ones when there is none)."""
    return MODEL_CLASSES[served_architecture({"architectures": list(architectures)})]


def masked_layers(model: nn.Module) -> list[int]:
    """Layers whose attention has a sliding window or soft-capped scores (on the torch path
    they run in the compiled CPU kernel when it is built, else in
    ``kernels.masked_attention``; in Triton's kernels on the Triton path)."""
    return [i for i, attn in _attentions(model) if attn.masked]


def _attentions(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer id, its RadixAttention) of the layers with one (a hybrid's linear layers have
    none)."""
    return [(i, layer.self_attn.attn) for i, layer in enumerate(model.model.layers)
            if hasattr(layer, "self_attn")]


def state_specs(model: nn.Module) -> dict:
    """A hybrid model's recurrent state of one sequence per linear layer (layer id ->
    ``radix_cache.state_pool.StateSpec``); {} for a model of attention layers only."""
    specs = getattr(model, "state_specs", None)
    return specs() if specs is not None else {}


def decode_windows(model: nn.Module) -> list[int]:
    """The sliding windows of layers without soft-capping: in decode they attend through
    the plain kernels over each sequence's last ``window`` slots (``WindowView``)."""
    return sorted({attn.sliding_window for _, attn in _attentions(model)
                   if attn.sliding_window is not None and attn.logit_cap is None})


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Linear and embedding parameters allocated, not initialised: the checkpoint fills
    every one (``plan_load`` requires each; an embedding model's missing LM head is never
    read). Initialising them cost seconds on a 1B model and wrote every page, so a quantized
    checkpoint's load peaked at its dense size; untouched pages of the dense buffers it
    replaces by ``meta`` are never resident."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = _leave_uninitialised
    try:
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


def _leave_uninitialised(self: nn.Module) -> None:
    return None


def build_model(config: ModelConfig, device: torch.device | str = "cpu",
                tp: TpGroup | None = None) -> nn.Module:
    """The model for ``config`` on ``device`` in ``config.resolve_dtype(device)``, its
    weights not loaded yet; with a tensor-parallel group ``tp``, this rank's slice."""
    cls = get_model_class(config.architectures)
    dtype = config.resolve_dtype(device)
    # Allocate parameters directly in the serving dtype on the device (no float32 copy).
    with torch.device(device), _default_dtype(dtype), building_with(tp or TpGroup()), \
            _no_weight_init():
        model = cls(config)
    masked = masked_layers(model)
    if masked:
        logger.info("%s: layers %s have a sliding window or soft-capped scores (torch path: "
                    "the CPU kernel when built, else kernels/masked_attention.py; "
                    "Triton: in-kernel)",
                    cls.__name__, masked)
    return model


def load_model(
    config: ModelConfig,
    model_dir: str | Path | None = None,
    device: torch.device | str = "cpu",
    tp: TpGroup | None = None,
    optional_weights: tuple[str, ...] = (),
) -> nn.Module:
    """``build_model`` and load its weights from ``model_dir`` (default:
    ``config.model_dir``'s safetensors); eval mode. ``optional_weights`` may be missing
    from the checkpoint (``plan_load``). A quantized checkpoint loads through
    ``executor/quant/loader.load_checkpoint`` instead."""
    model = build_model(config, device, tp)
    load_weights(model, model_dir if model_dir is not None else config.model_dir,
                 optional_weights)
    return model.eval()
