"""Where a quantized checkpoint's tensors come from: a GGUF file or safetensors files.

Each source presents the checkpoint under the names and logical (dequantized) shapes a
float checkpoint of the same model would have (``model.layers.0.self_attn.q_proj.weight``
``[n, k]``), so ``plan_load`` checks it like any other, and reads a tensor as a
``QuantWeight`` where the checkpoint holds it quantized, else as a float tensor.

    GGUFSource          runtime/gguf_file.py (validated container, names mapped to the
                        family's) + gguf_weights.py (blocks -> QuantWeight, exact)
    SafetensorsSource   hf_formats.py (the scheme from the config) + hf_layouts.py /
                        hf_packing.py (each linear read): AWQ, GPTQ, compressed-tensors,
                        FP8, W8A8 int8
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.executor.quant import safetensors_source
from radixlm.runtime.executor.quant.gguf_weights import GGUFSource
from radixlm.runtime.gguf_file import open_gguf
from radixlm.runtime.model_config import ModelConfig


class WeightSource(Protocol):
    """A quantized checkpoint, read tensor by tensor under the model's checkpoint names."""

    where: str  # the file or directory, for messages

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> logical shape of every tensor, from the headers only."""
        ...

    def read(self, name: str) -> torch.Tensor | QuantWeight:
        """The tensor ``name``: quantized where the checkpoint holds it quantized."""
        ...

    def close(self) -> None:
        """Release the files (after the load)."""
        ...


def quant_method(config: ModelConfig) -> str | None:
    """config.json's ``quantization_config.quant_method`` (None: a float checkpoint)."""
    quant = config.hf_config.get("quantization_config")
    return quant.get("quant_method") if isinstance(quant, dict) else None


def weight_source(config: ModelConfig, model_dir: str | Path,
                  requested: str | None = None) -> WeightSource | None:
    """The source of ``model_dir``'s quantized checkpoint, or None for a float one (and
    gpt-oss's MXFP4 experts, which its family file dequantizes at load). ``requested``:
    ``--quantization``, which must agree with the checkpoint (ValueError naming both)."""
    method = quant_method(config)
    if method == "mxfp4" and requested is None:
        return None
    if method == "gguf" or requested == "gguf":
        if method != "gguf":
            raise ValueError(f"--quantization gguf: {model_dir} is not a GGUF file's view "
                             f"(its quantization_config.quant_method is {method!r})")
        return GGUFSource(open_gguf(config.hf_config["quantization_config"]["gguf_file"]))
    return safetensors_source.source_for(config, model_dir, requested)
