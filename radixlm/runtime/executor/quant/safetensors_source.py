"""A quantized safetensors checkpoint (AWQ, GPTQ, compressed-tensors, FP8, W8A8) as a
``WeightSource``: the quantized linears under ``{prefix}.weight`` with their logical
``[n, k]`` shape, everything else as the float checkpoint would have it.

The headers are read once (dtype and shape of every tensor); ``hf_formats``' scheme names
the quantized linears, checks each one's tensors against each other and reads them. A
tensor is read only when the loader asks for it, from the file that holds it.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.executor.models.weights import safetensors_files
from radixlm.runtime.executor.quant.hf_formats import scheme_for
from radixlm.runtime.executor.quant.hf_layouts import QuantScheme, TensorInfo
from radixlm.runtime.model_config import ModelConfig

WEIGHT = ".weight"


class SafetensorsSource:
    """``model_dir``'s safetensors, read through ``scheme``."""

    def __init__(self, model_dir: str | Path, scheme: QuantScheme) -> None:
        self.where = str(model_dir)
        self.scheme = scheme
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}  # tensor name -> its open file
        infos: dict[str, TensorInfo] = {}
        for path in safetensors_files(model_dir):
            f = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = f.get_slice(name)
                infos[name] = (part.get_dtype(), tuple(part.get_shape()))
                self._files[name] = f
        self._quantized = {prefix: scheme.logical_shape(infos, prefix, self._get)
                           for prefix in scheme.quantized_modules(infos)}
        self._dense = {name: infos[name][1] for name in scheme.dense_tensors(infos)}

    def _get(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out = dict(self._dense)
        out.update({prefix + WEIGHT: nk for prefix, nk in self._quantized.items()})
        return out

    def read(self, name: str) -> torch.Tensor | QuantWeight:
        prefix = name.removesuffix(WEIGHT)
        if name.endswith(WEIGHT) and prefix in self._quantized:
            n, k = self._quantized[prefix]
            return self.scheme.read(self._get, prefix, n, k)
        return self._get(name)

    def close(self) -> None:
        self._stack.close()


def source_for(config: ModelConfig, model_dir: str | Path,
               requested: str | None) -> SafetensorsSource | None:
    """The source of ``model_dir`` when its quantization_config (or ``requested``) names
    a safetensors format; None for a float checkpoint."""
    scheme = scheme_for(config.hf_config, requested)
    return None if scheme is None else SafetensorsSource(model_dir, scheme)
