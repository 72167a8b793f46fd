"""Mixture of experts: a router picks ``top_k`` of ``num_experts`` gated MLPs per token, and
the token's output is their weighted sum.

    logits = x @ gate.T                          [N, E]
    weights, ids = route(logits)                 [N, K] each (the family's rule: ``route``)
    out[t] = sum_k weights[t, k] * expert[ids[t, k]](x[t])

Experts are stacked per layer (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], as
transformers 5 holds them); checkpoints keep one tensor per expert and projection
(Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen3-MoE's
``mlp.experts.{e}.gate_proj/up_proj/down_proj``), which ``checkpoint_layout`` places into
their expert's rows. A step groups the (token, expert) pairs by expert (one stable sort), so
each active expert runs one matmul over all its tokens (by oneDNN-prepacked copies of its
weights where the dense linears have them); outputs are weighted, put back in pair order
and summed over each token's k. That reads each expert's count on the host; on the Triton path
(CUDA) the experts run in the fused-MoE kernel instead (``kernels/fused_moe.py``), which
reads nothing back, so MoE models decode in CUDA graphs (docs/design.md). A quantized
checkpoint's experts (``quant_experts``) take the grouped path on every device.

gpt-oss's experts have biases (``expert_bias``: gate_up's per expert row, down's per
output, which rank 0 alone adds under tensor parallelism), gate and up interleaved and its
own clamped SwiGLU (``activation`` / ``activation_params``); its family file places its
checkpoint's stacked tensors. Its MXFP4 experts stay quantized the same way on a CPU (the
biases added by the quantized matmul, gate and up rows still interleaved).

Under tensor parallelism every rank holds every expert's share of the intermediate rows
(``I / tp_size`` of gate, up and down, like the dense MLP) and the whole router; the
weighted partial outputs end in one all-reduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import kernels
from radixlm.runtime.distributed.layers import Placement, Prepackable, Shard
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.distributed.quant_rows import QuantRows
from radixlm.runtime.executor.layers.activation import act_and_mul

SCORINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class MoESpec:
    """A family's experts: sizes, routing rule and checkpoint names."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool = True  # softmax_topk: divide the chosen k weights by their sum
    scoring: str = "softmax_topk"  # SCORINGS; topk_softmax: softmax over the k logits
    weights_in_dtype: bool = False  # Qwen3-MoE: weights rounded to the model dtype first
    router_bias: bool = False
    sparse_layers: tuple[bool, ...] | None = None  # None: every layer (Qwen3-MoE mixes)
    block_name: str = "mlp"  # the checkpoint's module name (Mixtral: block_sparse_moe)
    # the checkpoint's names of each expert's gate, up and down projections
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    activation: str | None = None  # the experts' own (gpt-oss); None: the decoder's
    activation_params: tuple[tuple[str, float], ...] = ()  # gpt-oss: alpha, limit
    expert_bias: bool = False  # gpt-oss: gate_up_proj_bias [E, 2I], down_proj_bias [E, H]

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoE scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in "
                             f"[1, num_experts ({self.num_experts})]")

    def is_sparse(self, layer_id: int) -> bool:
        return self.sparse_layers is None or self.sparse_layers[layer_id]


def num_experts_of(hf: dict) -> int:
    """config.json's expert count: ``num_local_experts`` (Mixtral; what transformers 5 writes
    for every family) or ``num_experts`` (Qwen3-MoE checkpoints on the Hub); 0: dense."""
    return int(hf.get("num_local_experts") or hf.get("num_experts") or 0)


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True,
          scoring: str = "softmax_topk") -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [N, K], expert ids int64 [N, K])`` from router logits ``[N, E]``.

    softmax_topk: softmax over all experts (in float32), the k largest, divided by their
    sum when ``renormalize`` (Mixtral; Qwen3-MoE's ``norm_topk_prob``). topk_softmax: the k
    largest logits, softmax over them (gpt-oss)."""
    if scoring == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Router(Prepackable, nn.Linear):
    """The router's linear, whole on every rank; prepacked on a CPU like the dense linears
    (torch's matmul of an unpacked bf16 weight cost ~60 us a layer at batch 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class FusedExperts(Prepackable, nn.Module):
    """``num_experts`` gated MLPs in two stacked parameters. On a CPU, ``prepack_weights``
    gives each expert oneDNN-packed copies of its two projections, as it does the dense
    linears (``Prepackable``): torch's matmul would repack an expert's weight on every call."""

    def __init__(self, num_experts: int, hidden: int, inter: int, activation: str,
                 bias: bool = False, adds_down_bias: bool = True,
                 activation_params: tuple[tuple[str, float], ...] = ()) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        # under tensor parallelism one rank adds down's bias to the summed partial outputs
        self.adds_down_bias = adds_down_bias
        self.act_and_mul = act_and_mul(activation, **dict(activation_params))
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # a quantized checkpoint's experts, (gate_up, down) per expert (executor/quant/
        # loader.py); the stacked parameters are then meta
        self.quant_experts: list[tuple[QuantRows, QuantRows]] | None = None

    @property
    def weight(self) -> torch.Tensor:  # what can_prepack checks (dtype, device)
        return self.gate_up_proj

    @property
    def packed(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return self.packed_experts

    def packed_nbytes(self) -> int:
        return self.gate_up_proj.nbytes + self.down_proj.nbytes

    def prepack(self) -> None:
        """(Re)build every expert's packed (gate_up, down) from the current parameters."""
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.packed_experts = [(reorder(self.gate_up_proj[e].detach(), None),
                                reorder(self.down_proj[e].detach(), None))
                               for e in range(self.num_experts)]

    def drop_packed(self) -> None:
        self.packed_experts = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                backend: str | None = None) -> torch.Tensor:
        """``x`` [N, H], ``ids`` / ``weights`` [N, K] -> [N, H]: each token's experts'
        outputs times their weights, summed. The Triton path (CUDA): the fused-MoE kernel,
        no host sync. Else one matmul pair per active expert."""
        if kernels.use_triton(backend, x) and self.quant_experts is None:
            act = functools.partial(self.act_and_mul, backend=backend)
            return kernels.fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids,
                                         act, backend, self.gate_up_proj_bias, self._down_bias)
        return self.grouped(x, ids, weights, backend)

    @property
    def _down_bias(self) -> torch.Tensor | None:
        """down's bias where this rank adds it (tensor parallelism: rank 0 alone)."""
        return self.down_proj_bias if self.adds_down_bias else None

    def _project(self, rows: torch.Tensor, expert: int, which: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``rows @ W.T (+ bias)`` for the expert's gate_up (``which`` 0) or down (1)."""
        if self.quant_experts is not None:
            return self.quant_experts[expert][which].matmul(rows, bias)
        if self.packed_experts is not None:
            packed = self.packed_experts[expert][which]
            return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return F.linear(rows, (self.gate_up_proj, self.down_proj)[which][expert], bias)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                backend: str | None = None) -> torch.Tensor:
        """The CPU path: pairs grouped by expert, one matmul pair per active expert."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        rows = x.index_select(0, order // k)  # [N * K, H], expert by expert
        outs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):  # over experts, never tokens
            if count:
                h = self.act_and_mul(
                    self._project(rows[start:start + count], expert, 0,
                                  self._bias(self.gate_up_proj_bias, expert)),
                    backend=backend)
                outs[start:start + count] = self._project(h, expert, 1,
                                                          self._bias(self._down_bias, expert))
                start += count
        scaled = (outs * weights.reshape(-1)[order, None]).to(x.dtype)
        # back in pair order (t * K + k): each token's K outputs adjacent, summed in k order
        by_pair = torch.empty_like(scaled).index_copy_(0, order, scaled)
        return by_pair.view(n, k, -1).sum(dim=1)

    @staticmethod
    def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
        return None if bias is None else bias[expert]


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and experts: the MLP of a sparse layer, ``forward(x, backend)``
    like the dense ``MLP``. Under tensor parallelism: this rank's rows of every expert."""

    def __init__(self, hidden: int, spec: MoESpec, activation: str) -> None:
        super().__init__()
        self.spec, self.tp = spec, get_tp_group()
        inter = spec.intermediate_size
        if inter % self.tp.size:
            raise ValueError(f"the experts' intermediate size ({inter}) is not divisible by "
                             f"tp_size ({self.tp.size})")
        local = inter // self.tp.size
        self.shard = Shard(0, self.tp.rank * local, (self.tp.rank + 1) * local, inter)
        self.gate = Router(hidden, spec.num_experts, bias=spec.router_bias)
        self.experts = FusedExperts(spec.num_experts, hidden, local, spec.activation or activation,
                                    spec.expert_bias, self.tp.rank == 0, spec.activation_params)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        spec = self.spec
        weights, ids = route(self.gate(x), spec.top_k, spec.renormalize, spec.scoring)
        if spec.weights_in_dtype:
            weights = weights.to(x.dtype)
        out = self.experts(x, ids, weights, backend)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        """Each expert's gate / up rows of ``gate_up_proj[e]`` and its ``down_proj[e]``,
        from this rank's slice of the checkpoint's per-expert tensors; the router (whole,
        on every rank) as ``{block}.gate``."""
        spec, rows = self.spec, self.shard
        inter, cols = rows.size, Shard(1, rows.start, rows.stop, rows.full)
        block = f"{prefix.rpartition('.')[0]}.{spec.block_name}"
        gate, up, down = spec.expert_names
        out = {f"{block}.gate.weight": Placement(f"{prefix}.gate.weight")}
        if spec.router_bias:
            out[f"{block}.gate.bias"] = Placement(f"{prefix}.gate.bias")
        gate_up, down_param = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        for e in range(spec.num_experts):
            name = f"{block}.experts.{e}"
            out[f"{name}.{gate}.weight"] = Placement(gate_up, (e, slice(0, inter)), rows)
            out[f"{name}.{up}.weight"] = Placement(gate_up, (e, slice(inter, 2 * inter)), rows)
            out[f"{name}.{down}.weight"] = Placement(down_param, e, cols)
        return out
