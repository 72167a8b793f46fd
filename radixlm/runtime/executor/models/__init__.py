"""Model registry (HF ``architectures`` name -> class) and ``load_model``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.distributed.parallel_state import TpGroup, building_with
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.executor.models.qwen2 import Qwen2ForCausalLM
from radixlm.runtime.executor.models.weights import load_weights
from radixlm.runtime.model_config import ModelConfig

__all__ = ["MODEL_CLASSES", "get_model_class", "load_model", "LlamaForCausalLM", "Qwen2ForCausalLM"]

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama plus a sliding window; ModelConfig caps the context at the window.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    # base models (transformers' AutoModel checkpoints, as embedding models are saved:
    # no LM head), served with --is-embedding
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
}


def get_model_class(architectures: Sequence[str]) -> type[LlamaForCausalLM]:
    """The class for the first supported name in config.json's ``architectures``."""
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(
        f"unsupported model architectures {list(architectures)}; "
        f"supported: {', '.join(MODEL_CLASSES)}"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    config: ModelConfig,
    model_dir: str | Path | None = None,
    device: torch.device | str = "cpu",
    tp: TpGroup | None = None,
    optional_weights: tuple[str, ...] = (),
) -> nn.Module:
    """Build the model for ``config`` on ``device`` in ``config.resolve_dtype(device)`` and
    load its weights from ``model_dir`` (default: ``config.model_dir``); eval mode. With a
    tensor-parallel group ``tp``, this rank's slice of it (layers and weights);
    ``optional_weights`` may be missing from the checkpoint (``plan_load``)."""
    cls = get_model_class(config.architectures)
    dtype = config.resolve_dtype(device)
    # Allocate parameters directly in the serving dtype on the device (no float32 copy).
    with torch.device(device), _default_dtype(dtype), building_with(tp or TpGroup()):
        model = cls(config)
    load_weights(model, model_dir if model_dir is not None else config.model_dir,
                 optional_weights)
    return model.eval()
