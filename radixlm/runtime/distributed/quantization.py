"""Weight-only int8 of an unquantized checkpoint (``--torchao-config int8wo``, SGLang's name).

At load, every projection (q/k/v, o, gate/up and down: ColumnParallelLinear and
RowParallelLinear, SGLang's ``proj`` filter) is quantized per output channel
(``kernels/int8_linear.py``); its dense weight is then replaced by a ``meta`` tensor of the
same shape and dtype, so only the int8 copy and its scales stay in memory while
``checkpoint_layout`` / ``plan_load`` still see the shapes. The embeddings and the LM head
stay dense, as SGLang's torchao path leaves them: the LM head decides every sampled token,
and the embedding is a row lookup that int8 would not speed up.

Each tensor-parallel rank quantizes its own shard after loading it; the row-parallel
layers (o, down: shards of columns) take each row's maximum over the ranks (one
all-reduce per layer), so every rank holds exactly its slice of the single-rank int8
weights and tp_size does not change the numbers. A bfloat16 weight is then packed for the
weight-only kernel where the CPU has it (``int8_linear.pack``) and the row-major int8 copy
dropped: ``int8_packed`` holds the packing, ``qweight`` a ``meta`` placeholder. A weight
update gives the layers back uninitialised dense weights to copy the checkpoint into
(``dense_weights``) and quantizes (and packs) again afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from radixlm.kernels.int8_linear import pack, quantize_per_channel
from radixlm.runtime.distributed.layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


def quantizable_layers(model: nn.Module) -> list[nn.Module]:
    """The projections ``--torchao-config int8wo`` quantizes (not the LM head)."""
    return [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in quantizable_layers(model) if m.qweight is not None]


def quantize_layer(layer: nn.Module) -> None:
    """Quantize ``layer``'s dense weight and drop it (a ``meta`` placeholder keeps its
    shape and dtype for the checkpoint loader)."""
    weight = layer.weight
    assert not weight.is_meta, "the layer holds no dense weight to quantize"
    row_max = None
    if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:  # a shard of columns
        row_max = layer.tp.all_reduce_max(weight.detach().abs().amax(dim=1).float())
    q, layer.scales = quantize_per_channel(weight.detach(), row_max)
    layer.int8_packed = pack(q, layer.scales)
    layer.qweight = q if layer.int8_packed is None else \
        torch.empty(q.shape, dtype=torch.int8, device="meta")  # the packing replaces it
    layer.drop_packed()
    layer.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                requires_grad=False)


def quantize_weights(model: nn.Module) -> int:
    """Quantize every projection of ``model`` to int8; returns how many."""
    layers = quantizable_layers(model)
    for layer in layers:
        quantize_layer(layer)
    return len(layers)


def quantized_weight_bytes(model: nn.Module) -> int:
    """Memory of the int8 weights (or their packings) and their scales."""
    return sum((m.qweight.nbytes if m.int8_packed is None else m.int8_packed.nbytes())
               + m.scales.nbytes for m in quantized_layers(model))


def dense_weight_bytes(model: nn.Module) -> int:
    """What the quantized projections' dense weights would take (for the log line)."""
    return sum(m.weight.nelement() * m.weight.element_size() for m in quantized_layers(model))


@contextmanager
def dense_weights(model: nn.Module) -> Iterator[bool]:
    """For the block, every quantized layer holds an uninitialised dense weight for a
    checkpoint to be copied into (plan the copy inside the block); on leaving, even by an
    exception, the dense weights are quantized again and dropped. Yields whether any
    layer was quantized (if not, nothing changes)."""
    layers = quantized_layers(model)
    for layer in layers:
        meta = layer.weight
        layer.weight = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype,
                                                device=layer.scales.device),
                                    requires_grad=False)
    try:
        yield bool(layers)
    finally:
        for layer in layers:
            quantize_layer(layer)
