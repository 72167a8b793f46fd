"""gpt-oss's MXFP4 checkpoint as a ``WeightSource``: its experts kept as quantized weights.

The released checkpoints hold every expert projection as an MXFP4 pair (``X_blocks`` /
``X_scales``, ``models/mxfp4.py``) and everything else in bf16. Read through this source,
each pair is E ``QuantWeight`` s (one per expert, w8 codes in -12..12: exact), which the
loader keeps in the experts' ``quant_experts`` and the CPU kernel packs as w6 (0.8 bytes a
weight, against 2 for the bf16 the float load dequantizes to); the other tensors read as
they are. The loader takes this source on one CPU rank where the kernel library is built
(``loader.packs_mxfp4``); elsewhere the experts are dequantized at load as before.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.executor.models import mxfp4
from radixlm.runtime.executor.models.weights import safetensors_files


class Mxfp4Source:
    """``model_dir``'s safetensors, each MXFP4 pair read as one list of per-expert
    ``QuantWeight`` s under the pair's ``X_blocks`` name (shapes: ``mxfp4.logical_shapes``)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.where = str(model_dir)
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}  # tensor name -> its open file (a pair may be split)
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in safetensors_files(model_dir):
            f = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._files[name] = f
                self._shapes[name] = tuple(f.get_slice(name).get_shape())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return mxfp4.logical_shapes(self._shapes)

    def read(self, name: str) -> torch.Tensor | list[QuantWeight]:
        """The tensor ``name``; a stacked MXFP4 pair ``[E, N, K]`` as E quantized weights."""
        scales = name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES
        if name.endswith(mxfp4.BLOCKS) and scales in self._files:
            blocks = self._files[name].get_tensor(name)
            if blocks.dim() != 4:
                raise ValueError(f"{self.where}: MXFP4 tensor {name} "
                                 f"{tuple(blocks.shape)} is not stacked experts [E, N, G, 16]")
            return mxfp4.quant_weights(blocks, self._files[scales].get_tensor(scales))
        return self._files[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()
