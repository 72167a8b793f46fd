"""Loading a quantized checkpoint into a model: each linear keeps its quantized weight.

A quantized checkpoint (a GGUF file, or safetensors in AWQ / GPTQ / compressed-tensors /
FP8 / W8A8 layouts) is read through a ``WeightSource``: every tensor under the name and
logical (dequantized) shape the model's ``checkpoint_layout`` expects, so ``plan_load``
checks it exactly as it checks a float checkpoint (missing, unexpected and misshapen
tensors named, nothing touched on a mismatch). Then each tensor is read once:

    a QuantWeight for a linear's rows         -> kept: the layer's ``quant`` (QuantRows),
    (Prepackable weights, MoE experts)           its dense parameter replaced by ``meta``
    a QuantWeight for anything else            -> dequantized into the parameter
    (embeddings, a layer mixing dense parts)     (an embedding is a row lookup)
    a float tensor                             -> copied, as from a float checkpoint

Stacked experts (``[E, N, K]``: gpt-oss's, from a GGUF file or its MXFP4 checkpoint) read
as a list of E ``QuantWeight`` s, one per expert, placed like the stack. Rows may be placed
with a stride: gpt-oss's GGUF gate and up fill the even and odd rows of ``gate_up_proj``
(its activation reads them interleaved); their rows are interleaved in one weight.
A parameter's blocks are packed as soon as its last tensor is read, so a load holds one
parameter's unpacked codes at a time beside the packed model.

``dense=True`` dequantizes everything (the float reference the tests compare against).
One rank only: a quantized weight's groups run along the columns a row-parallel shard
would cut, so ``check_tp_split`` refuses tp_size > 1 with a quantized checkpoint (gpt-oss's
MXFP4 checkpoint, which it lets through, is dequantized there: ``packs_mxfp4``).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch import nn

from radixlm.kernels import quant_linear
from radixlm.kernels.qweight import QuantWeight, stack_rows
from radixlm.runtime.distributed.layers import Placement, Prepackable
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.distributed.quant_rows import QuantRows
from radixlm.runtime.executor.layers.moe import FusedExperts
from radixlm.runtime.executor.models.weights import LoadTarget, load_weights, plan_load
from radixlm.runtime.executor.quant.mxfp4_source import Mxfp4Source
from radixlm.runtime.executor.quant.sources import WeightSource, quant_method, weight_source
from radixlm.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def load_checkpoint(model: nn.Module, config: ModelConfig, model_dir: str | Path,
                    optional: tuple[str, ...] = (), quantization: str | None = None) -> Counter:
    """Load ``model_dir``'s checkpoint into ``model``: through ``load_quantized`` when it
    is quantized (its quantization_config, a GGUF view, or ``quantization``: SGLang's
    name, which must agree with the checkpoint), else ``load_weights``. Returns how many
    weights of each kind stay quantized (empty: a float checkpoint)."""
    source = weight_source(config, model_dir, quantization)
    if source is None and packs_mxfp4(model, config):
        source = Mxfp4Source(model_dir)
    if source is None:
        load_weights(model, model_dir, optional)
        return Counter()
    try:
        return load_quantized(model, source, optional)
    finally:
        source.close()


def packs_mxfp4(model: nn.Module, config: ModelConfig) -> bool:
    """Whether gpt-oss's MXFP4 experts stay quantized (``Mxfp4Source``): an MXFP4
    checkpoint on one CPU rank with the kernel library built. Elsewhere (CUDA, tensor
    parallelism, no library) they are dequantized at load (``models/mxfp4.py``)."""
    device = next(model.parameters()).device
    return (quant_method(config) == "mxfp4" and device.type == "cpu"
            and get_tp_group().size == 1 and quant_linear.isa() >= 0)


def load_quantized(model: nn.Module, source: WeightSource, optional: tuple[str, ...] = (),
                   dense: bool = False) -> Counter:
    """Check ``source`` against ``model`` (``plan_load``), then read it in (see the module
    docstring). Returns how many weights of each kind stay quantized."""
    targets = plan_load(model, source.where, optional, shapes=source.shapes())
    blocks: dict[str, list[tuple[Placement, QuantWeight]]] = defaultdict(list)
    unread = Counter(t.place.param for places in targets.values() for t in places)
    kinds: Counter = Counter()
    with torch.no_grad():
        for name, places in targets.items():
            value = source.read(name)
            for target in places:
                shard, param = target.shard, target.place.param
                assert shard is None or shard.size == shard.full, \
                    f"{name}: a quantized checkpoint loads on one rank, not {shard}"
                if not dense and _keeps_quantized(model, target, value):
                    blocks[param].extend(_parts(target.place, value))
                else:
                    _copy_dense(target, value)
                unread[param] -= 1
                if not unread[param] and param in blocks:  # packed now: its codes freed
                    kinds.update(_attach(model, param, blocks.pop(param)))
    for m in model.modules():
        assert not isinstance(m, FusedExperts) or m.quant_experts is None or all(
            all(pair) for pair in m.quant_experts), \
            "an MoE layer whose experts are quantized in gate_up but not down (or back)"
    logger.info("loaded %d tensors from %s: %s", len(targets), source.where,
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "all dense")
    return kinds


def _parts(place: Placement, value: QuantWeight | list[QuantWeight]
           ) -> list[tuple[Placement, QuantWeight]]:
    """``value`` as (placement, weight) pairs: stacked experts one pair per expert, at
    ``(expert, rows)`` (``rows``: the stack's rows within each expert, or all of them)."""
    if isinstance(value, QuantWeight):
        return [(place, value)]
    rows = place.rows
    assert rows is None or isinstance(rows, tuple) and rows[0] == slice(None), \
        f"stacked experts placed at {rows} of {place.param}: not every expert"
    inner = None if rows is None else rows[1]
    return [(place._replace(rows=(e, inner)), qw) for e, qw in enumerate(value)]


def _copy_dense(target: LoadTarget, value: torch.Tensor | QuantWeight | list[QuantWeight]
                ) -> None:
    if isinstance(value, QuantWeight):
        value = value.dequantize(torch.float32)
    elif isinstance(value, list):  # stacked experts
        value = torch.stack([qw.dequantize(torch.float32) for qw in value])
    target.tensor.copy_(value)


def _keeps_quantized(model: nn.Module, target: LoadTarget,
                     value: torch.Tensor | QuantWeight | list[QuantWeight]) -> bool:
    """Whether ``value`` stays quantized at ``target``: a quantized weight where the layer
    multiplies quantized; stacked experts (gpt-oss's, from a GGUF file) on a CPU only, as
    ``packs_mxfp4`` keeps the HF checkpoint's (elsewhere dequantized at load)."""
    if isinstance(value, torch.Tensor) or not _quant_site(model, target):
        return False
    return isinstance(value, QuantWeight) or target.tensor.device.type == "cpu"


def _quant_site(model: nn.Module, target: LoadTarget) -> bool:
    """Whether ``target`` is rows of a weight that can multiply quantized."""
    module_path, _, attr = target.place.param.rpartition(".")
    module = model.get_submodule(module_path)
    if isinstance(module, FusedExperts):
        return attr in EXPERT_PARAMS and not target.place.transposed
    return isinstance(module, Prepackable) and attr == "weight"


def _attach(model: nn.Module, param: str, parts: list[tuple[Placement, QuantWeight]]) -> list:
    """Give ``param``'s module the quantized blocks and drop its dense parameter; returns
    the blocks' kinds. A parameter only partly covered by quantized blocks (the rest came
    dense) gets them dequantized into it instead."""
    module_path, _, attr = param.rpartition(".")
    module = model.get_submodule(module_path)
    dense = getattr(module, attr)
    if isinstance(module, FusedExperts):
        experts = _expert_rows(parts, dense.shape[0], dense.shape[1])
        if experts is None:
            return _dequantize_into(dense, parts)
        if module.quant_experts is None:
            module.quant_experts = [[None, None] for _ in range(module.num_experts)]
        which = EXPERT_PARAMS.index(attr)
        for e, rows in enumerate(experts):
            module.quant_experts[e][which] = QuantRows(rows)
    else:
        rows = _ordered_rows([(p.rows, qw) for p, qw in parts], dense.shape[0])
        if rows is None:
            return _dequantize_into(dense, parts)
        module.quant = QuantRows(rows)
    setattr(module, attr, nn.Parameter(torch.empty(dense.shape, dtype=dense.dtype,
                                                   device="meta"), requires_grad=False))
    return [qw.kind for _, qw in parts]


def _ordered_rows(parts: list[tuple[slice | None, QuantWeight]],
                  n: int) -> list[QuantWeight] | None:
    """The blocks top to bottom when they cover rows ``[0, n)`` exactly, else None (strided
    rows: ``_interleaved``)."""
    if any(rows is not None and rows.step not in (None, 1) for rows, _ in parts):
        return _interleaved(parts, n)
    spans = sorted(((0, n) if rows is None else (rows.start, rows.stop), qw)
                   for rows, qw in parts)
    at = 0
    for (start, stop), qw in spans:
        if start != at or stop - start != qw.n:
            return None
        at = stop
    return [qw for _, qw in spans] if at == n else None


def _interleaved(parts: list[tuple[slice | None, QuantWeight]],
                 n: int) -> list[QuantWeight] | None:
    """Blocks placed at strided rows (gpt-oss's gate at rows 0, 2, 4, ... and up at 1, 3,
    5, ...) as one weight with their rows where placed, when they cover ``[0, n)`` exactly
    and share a layout (rows are independent in every format: exact); else None."""
    where = [torch.arange(n)[slice(None) if rows is None else rows] for rows, _ in parts]
    stacked = stack_rows([qw for _, qw in parts])
    order = torch.cat(where)
    if stacked is None or any(len(w) != qw.n for w, (_, qw) in zip(where, parts)) \
            or not torch.equal(order.sort().values, torch.arange(n)):
        return None
    rows = torch.argsort(order)  # row r of the weight is row rows[r] of the stack
    return [QuantWeight(stacked.kind, n, stacked.k, stacked.group, stacked.data[rows],
                        stacked.scales[rows],
                        None if stacked.mins is None else stacked.mins[rows], stacked.perm)]


def _expert_rows(parts: list[tuple[Placement, QuantWeight]], experts: int,
                 n: int) -> list[list[QuantWeight]] | None:
    """Each expert's blocks top to bottom, when every expert's rows are covered."""
    by_expert: dict[int, list[tuple[slice | None, QuantWeight]]] = defaultdict(list)
    for place, qw in parts:
        e, rows = place.rows if isinstance(place.rows, tuple) else (place.rows, None)
        by_expert[e].append((rows, qw))
    out = [_ordered_rows(by_expert.get(e, []), n) for e in range(experts)]
    return None if any(rows is None for rows in out) else out


def _dequantize_into(dense: torch.Tensor, parts: list[tuple[Placement, QuantWeight]]) -> list:
    for place, qw in parts:
        rows = place.rows
        dense[rows if rows is not None else slice(None)].copy_(qw.dequantize(torch.float32))
    logger.warning("%d quantized tensors of a %s parameter were dequantized (the rest of its "
                   "rows came dense)", len(parts), tuple(dense.shape))
    return []


def quant_weight_bytes(model: nn.Module) -> int:
    """Memory of every quantized weight of ``model`` (blocks and packed copies)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Prepackable) and m.quant is not None:
            total += m.quant.nbytes()
        if isinstance(m, FusedExperts) and m.quant_experts is not None:
            total += sum(r.nbytes() for pair in m.quant_experts for r in pair)
    return total


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Prepackable) and m.quant is not None
               or isinstance(m, FusedExperts) and m.quant_experts is not None
               for m in model.modules())
