"""Tensor-parallel layers: at tp_size 1 each is exactly the torch module it subclasses.

    ColumnParallelLinear  rows split:    each rank holds its heads' rows of q, k and v (or
                          its share of gate and up), fused in one matmul as at tp_size 1;
                          no communication
    RowParallelLinear     columns split: each rank multiplies its share of the input
                          features, then one all-reduce sums the partial outputs
    VocabParallelEmbedding  vocabulary rows split: ids outside a rank's rows embed to 0,
                          then one all-reduce
    ParallelLMHead        vocabulary rows split: the partial logits are gathered on rank 0
                          only, which is where sampling happens

Attention heads are split across ranks; KV heads too, and when there are fewer KV heads
than ranks each is replicated on ``tp_size / kv_heads`` ranks (as vLLM and SGLang do). The
vocabulary is padded to a multiple of ``tp_size`` (padded rows are zero and never read).

``checkpoint_layout(prefix)`` says which slice of which checkpoint tensor fills which rows
of the layer's parameters, so each rank reads only its slices (``models/weights.py``).

On a CPU the linear layers and the LM head can hold a prepacked copy of their weight
(``Prepackable.prepack``): oneDNN's blocked layout, made once, so a matmul no longer
repacks the whole weight on every call. That is most of a decode step's matmul cost at
small batches (float32: measured 1.5-2.9x faster at 32 rows, 1.15-1.5x at 512-2048 rows;
bfloat16, where the CPU has bf16 instructions: 1.3-1.7x at 1-128 rows; see
docs/benchmarks.md). In float32 the panels of ``kernels/fma_linear.py`` take the products
they run faster than oneDNN: decode steps' on AVX-512, up to 2,048 rows on AVX2 (where
oneDNN's copy is then not made, and torch's matmul over the dense weight takes the
larger ones, as fast there); a bfloat16 model's on AVX2 too (bf16 panels: torch's bf16
matmul emulates bf16 there, 7-9x slower). The dense weight stays the parameter
(checkpoint loading, weight updates and TP slicing write it), so whoever changes it must
``prepack`` again.

With ``--torchao-config int8wo`` the projections multiply by an int8 copy instead
(``qweight`` / ``scales``, made by ``quantization.py``; their dense weight is dropped).
A quantized checkpoint's layers (GGUF, AWQ, GPTQ, FP8, W8A8: ``executor/quant/``) hold
their weight as ``quant`` (``quant_rows.QuantRows``) and a ``meta`` placeholder of the
dense shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import amx_linear, fma_linear
from radixlm.kernels.int8_linear import int8_linear
from radixlm.kernels.quant_linear import QuantPacked
from radixlm.runtime.distributed.parallel_state import TpGroup, get_tp_group
from radixlm.runtime.distributed.quant_rows import QuantRows
from radixlm.runtime.model_config import ModelConfig, cpu_has_bf16

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` along ``dim`` of a checkpoint tensor ``full`` rows long there."""

    dim: int
    start: int
    stop: int
    full: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class Placement(NamedTuple):
    """Where one checkpoint tensor goes: parameter ``param`` (``rows`` of it, or all of it
    when None), from ``shard`` of the checkpoint tensor (all of it when None)."""

    param: str
    rows: slice | int | tuple[int | slice, slice] | None = None  # int / tuple: stacked experts
    shard: Shard | None = None
    # the checkpoint holds the parameter's last two dims swapped (gpt-oss's stacked experts,
    # [E, in, out]); ``shard`` indexes the checkpoint's dims
    transposed: bool = False


class Placements(tuple):
    """Several row ranges of one parameter, each filled from a slice of the same checkpoint
    tensor (under tensor parallelism: this rank's q, k and v rows of a fused ``in_proj``).
    ``plan_load`` takes any tuple of placements; ``param`` names their parameter."""

    @property
    def param(self) -> str:
        return self[0].param


def sliced_placement(param: str, shards: Sequence[Shard], start: int = 0
                     ) -> Placement | Placements:
    """Parameter ``param``'s rows from ``start`` on, filled by ``shards`` of one checkpoint
    tensor in order (each ``shard.size`` rows along dim 0 of the parameter). Slices that
    follow each other in the checkpoint are read as one (at tp_size 1: one placement)."""
    merged: list[Shard] = []
    for s in shards:
        last = merged[-1] if merged else None
        if last is not None and (last.dim, last.stop, last.full) == (s.dim, s.start, s.full):
            merged[-1] = Shard(s.dim, last.start, s.stop, s.full)
        else:
            merged.append(s)
    places = []
    for s in merged:
        places.append(Placement(param, slice(start, start + s.size), s))
        start += s.size
    return places[0] if len(places) == 1 else Placements(places)


# --- the split of a model ----------------------------------------------------------------
def check_tp_split(config: ModelConfig, tp_size: int) -> None:
    """ValueError naming the sizes when the model cannot be split over ``tp_size`` ranks."""
    heads, kv, inter = (config.num_attention_heads, config.num_key_value_heads,
                        config.intermediate_size)
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by tp_size")
    if kv % tp_size and tp_size % kv:
        problems.append(f"num_key_value_heads ({kv}) neither divides nor is divisible by "
                        "tp_size")
    if inter % tp_size:
        problems.append(f"intermediate_size ({inter}) is not divisible by tp_size")
    moe_inter = config.hf_config.get("moe_intermediate_size")  # Qwen3-MoE's experts
    if moe_inter and moe_inter % tp_size:
        problems.append(f"moe_intermediate_size ({moe_inter}) is not divisible by tp_size")
    problems += _linear_layer_problems(config.hf_config, tp_size)
    quant = config.hf_config.get("quantization_config")
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    if mxfp4 and not inter % tp_size and (inter // tp_size) % 32:  # models/mxfp4.BLOCK
        # gpt-oss's down projection is read in whole 32-element MXFP4 blocks along I
        problems.append(f"intermediate_size ({inter}) / tp_size is not a multiple of the "
                        "MXFP4 block of 32")
    if isinstance(quant, dict) and not mxfp4 and tp_size > 1:
        # executor/quant/loader.py: groups along the columns a row-parallel shard would cut
        problems.append(f"a quantized checkpoint (quant_method {quant.get('quant_method')!r}) "
                        "is served on one rank")
    if problems:
        raise ValueError(f"tp_size {tp_size} cannot split this model: {'; '.join(problems)}")


# a hybrid's linear layers (Gated DeltaNet's key heads, Mamba2's heads) and shared experts
# split over the ranks too (models/qwen3_next.py, models/mamba_hybrid.py); Mamba2's groups
# split, or with fewer groups than ranks each is shared by tp_size / n_groups ranks
_HYBRID_SPLITS = ("linear_num_key_heads", "linear_num_value_heads", "mamba_num_heads",
                  "mamba_n_heads", "shared_expert_intermediate_size",
                  "moe_shared_expert_intermediate_size", "shared_intermediate_size")
_MAMBA2_GROUPS = ("n_groups", "mamba_n_groups")


def _linear_layer_problems(hf: dict, tp_size: int) -> list[str]:
    problems = [f"{field} ({hf[field]}) is not divisible by tp_size"
                for field in _HYBRID_SPLITS if isinstance(hf.get(field), int)
                and hf[field] % tp_size]
    return problems + [f"{field} ({hf[field]}) neither divides nor is divisible by tp_size"
                       for field in _MAMBA2_GROUPS if isinstance(hf.get(field), int)
                       and hf[field] % tp_size and tp_size % hf[field]]


def local_kv_heads(config: ModelConfig, tp_size: int) -> int:
    """KV heads each rank holds (and keeps in its KV pool): at least one."""
    return max(config.num_key_value_heads // tp_size, 1)


def kv_head_start(config: ModelConfig, tp_size: int, rank: int) -> int:
    """The first KV head rank ``rank`` holds. With fewer KV heads than ranks, consecutive
    ranks share (replicate) one KV head."""
    return rank * config.num_key_value_heads // tp_size


def qkv_shards(config: ModelConfig, tp: TpGroup) -> dict[str, Shard]:
    """This rank's rows of q_proj, k_proj and v_proj."""
    d = config.head_dim
    q_heads = config.num_attention_heads // tp.size
    kv_heads = local_kv_heads(config, tp.size)
    kv_index = kv_head_start(config, tp.size, tp.rank)
    q = Shard(0, tp.rank * q_heads * d, (tp.rank + 1) * q_heads * d, config.q_size)
    kv = Shard(0, kv_index * d, (kv_index + kv_heads) * d, config.kv_size)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv}


def section_shards(sections: Sequence[int], tp: TpGroup, dim: int = 0) -> tuple[Shard, ...]:
    """This rank's share of each section of a tensor whose rows along ``dim`` are
    ``sections`` one after another, each split evenly over the ranks (a fused projection's
    parts: Mamba2's gate, x, B, C and dt; Qwen3.5's q, k and v). The caller checked that
    every section divides."""
    out, offset = [], 0
    for n in sections:
        assert n % tp.size == 0, f"a section of {n} rows over {tp.size} ranks"
        local = n // tp.size
        out.append(Shard(dim, offset + tp.rank * local, offset + (tp.rank + 1) * local,
                         sum(sections)))
        offset += n
    return tuple(out)


def split_rows(full: int, tp: TpGroup, what: str) -> Shard:
    """This rank's share of ``full`` rows; ValueError naming ``what`` when they do not
    split."""
    if full % tp.size:
        raise ValueError(f"{what} ({full}) is not divisible by tp_size ({tp.size})")
    return section_shards([full], tp)[0]


def gate_up_shards(config: ModelConfig, tp: TpGroup) -> dict[str, Shard]:
    """This rank's rows of gate_proj and up_proj."""
    inter = config.intermediate_size
    n = inter // tp.size
    part = Shard(0, tp.rank * n, (tp.rank + 1) * n, inter)
    return {"gate_proj": part, "up_proj": part}


# --- layers -----------------------------------------------------------------------------
def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be prepacked: CPU float32; bfloat16 where the CPU has bf16
    instructions (AVX512-BF16 / AMX: oneDNN's bf16 kernels; without them oneDNN would
    emulate bf16, slower than torch's own matmul) or on an AVX2 build of our kernels
    (fma_linear's bf16 panels, products in float32 FMAs)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                             and (cpu_has_bf16()
                                                  or fma_linear.supports(weight)))


class Prepackable:
    """A layer computing ``x @ weight.T (+ bias)``, optionally from a prepacked copy."""

    weight: torch.Tensor
    packed: torch.Tensor | None = None  # oneDNN's layout of ``weight``; None: use weight
    # bf16 on an AMX CPU: also the tile layout of kernels/amx_linear.py, for products of at
    # most amx_linear.MAX_ROWS rows (decode steps), which it reads at up to twice oneDNN's
    # bandwidth; oneDNN's copy takes the rest
    amx_packed: torch.Tensor | None = None
    # float32: the panels of kernels/fma_linear.py, for products of at most
    # fma_linear.max_rows() rows, which they run faster than oneDNN's float32 kernels (on
    # AVX-512 decode steps', on AVX2 up to 2,048 rows; there oneDNN's copy is not made:
    # packed stays None and larger products take torch's matmul over the dense weight);
    # bfloat16 on AVX2 (no bf16 instructions): bf16 panels, every product
    fma_packed: torch.Tensor | None = None
    # weight-only int8 (quantization.py): int8 [N, K] and scales [N]; weight is then meta
    qweight: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    # bf16 on a CPU with AVX512-BF16: the weight-only kernel's packing of them (qweight is
    # then meta; int8_linear.pack)
    int8_packed: QuantPacked | None = None
    # a quantized checkpoint's weight (executor/quant/loader.py); weight is then meta
    quant: QuantRows | None = None

    def prepack(self) -> None:
        """(Re)build the packed copy from the current weight."""
        assert can_prepack(self.weight), f"cannot prepack a {self.weight.dtype} weight " \
            f"on {self.weight.device}"
        fma = fma_linear.supports(self.weight)
        self.fma_packed = fma_linear.pack(self.weight) if fma else None
        self.packed = None if fma and fma_linear.replaces_onednn() else \
            torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.amx_packed = amx_linear.pack(self.weight) if amx_linear.supports(self.weight) \
            else None

    def drop_packed(self) -> None:
        self.packed = self.amx_packed = self.fma_packed = None

    def is_prepacked(self) -> bool:
        return self.packed is not None or self.fma_packed is not None

    def packed_nbytes(self) -> int:
        """Memory of the packed copies (what they hold besides the dense weight)."""
        onednn = self.weight.nbytes if self.packed is not None else 0
        return onednn + sum(t.nbytes for t in (self.amx_packed, self.fma_packed)
                            if t is not None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.matmul(x, bias)
        if self.qweight is not None:
            return int8_linear(x, self.qweight, self.scales, bias, self.int8_packed)
        if self.amx_packed is not None and amx_linear.takes(x):
            return amx_linear.linear(x, self.amx_packed, self.weight.shape[0], bias)
        if self.fma_packed is not None and fma_linear.takes(x):
            return fma_linear.linear(x, self.fma_packed, self.weight.shape[0], bias)
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def packed_layers(model: nn.Module) -> list[Prepackable]:
    """The layers of ``model`` that hold a packed copy of their weight."""
    return [m for m in model.modules() if isinstance(m, Prepackable) and m.is_prepacked()]


def prepack_weights(model: nn.Module, on: bool = True) -> int:
    """Prepack (or, with ``on`` false, drop the packed copies of) every Prepackable layer
    of ``model``; returns how many layers hold a packed copy."""
    layers = [m for m in model.modules() if isinstance(m, Prepackable)]
    n = 0
    for module in layers:
        module.drop_packed()
        if on and can_prepack(module.weight):
            try:
                module.prepack()
            except RuntimeError as e:  # a oneDNN build without this op (some ARM builds)
                logger.warning("cannot prepack weights (%s); using torch's matmul", e)
                for m in layers:
                    m.drop_packed()
                return 0
            n += 1
    return n


def _shards_of(part: Shard | Sequence[Shard]) -> tuple[Shard, ...]:
    return (part,) if isinstance(part, Shard) else tuple(part)


class ColumnParallelLinear(Prepackable, nn.Linear):
    """Checkpoint tensors ``parts`` (name -> this rank's shard of its rows, or several
    shards of it: the parts of a fused checkpoint tensor, ``section_shards``), stacked in one
    matmul in that order. No communication: the output stays split by rank."""

    def __init__(self, in_features: int, parts: Mapping[str, Shard | Sequence[Shard]],
                 bias: bool) -> None:
        self.parts = dict(parts)
        rows = sum(s.size for part in self.parts.values() for s in _shards_of(part))
        super().__init__(in_features, rows, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement | Placements]:
        out: dict[str, Placement | Placements] = {}
        start = 0
        module_path = prefix.rpartition(".")[0]
        for part, shard in self.parts.items():
            name = f"{module_path}.{part}" if module_path else part
            shards = _shards_of(shard)
            out[f"{name}.weight"] = sliced_placement(f"{prefix}.weight", shards, start)
            if self.bias is not None:
                out[f"{name}.bias"] = sliced_placement(f"{prefix}.bias", shards, start)
            start += sum(s.size for s in shards)
        return out


class RowParallelLinear(Prepackable, nn.Linear):
    """``in_features`` split over the ranks; one all-reduce sums the partial outputs (the
    bias is added once, after it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self.tp = get_tp_group()
        if in_features % self.tp.size:
            raise ValueError(f"in_features ({in_features}) is not divisible by tp_size "
                             f"({self.tp.size})")
        local = in_features // self.tp.size
        super().__init__(local, out_features, bias=bias)
        self.shard = Shard(1, self.tp.rank * local, (self.tp.rank + 1) * local, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        out = {f"{prefix}.weight": Placement(f"{prefix}.weight", None, self.shard)}
        if self.bias is not None:
            out[f"{prefix}.bias"] = Placement(f"{prefix}.bias")
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_start + rows)`` of the (padded) vocabulary on this rank."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        rows = math.ceil(vocab_size / self.tp.size)
        super().__init__(rows, hidden)
        self.vocab_start = self.tp.rank * rows
        # rows of this rank that the checkpoint fills (the rest pads the vocabulary)
        self.valid_rows = max(min(vocab_size - self.vocab_start, rows), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local * mine, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        shard = Shard(0, self.vocab_start, self.vocab_start + self.valid_rows, self.vocab_size)
        return {f"{prefix}.weight": Placement(f"{prefix}.weight", slice(0, self.valid_rows),
                                              shard)}


class ParallelLMHead(Prepackable, VocabParallelEmbedding):
    """``hidden -> vocab`` logits: rank 0 gets all of them, the other ranks ``[M, 0]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(x)  # [M, rows of this rank]
        if self.tp.size == 1:
            return logits
        return self.tp.gather_last_dim(logits)[..., : self.vocab_size]
