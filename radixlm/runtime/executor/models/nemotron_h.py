"""Nemotron-H: a stack of single-mixer blocks, each ``x + mixer(RMSNorm(x))``, the mixer one
of (``layers_block_type``, or the released files' ``hybrid_override_pattern``)::

    M  linear_attention   Mamba2 (``mamba_hybrid.Mamba2Layer``: state in the state pool)
    *  full_attention     attention without positional encoding (no RoPE), K/V in the pool
    -  mlp                up_proj -> relu(x)^2 -> down_proj (no gate)
    E  moe                sigmoid router with a score-correction bias (top k of the groups'
                          best, DeepSeek-V3's rule), relu^2 experts, plus a shared expert

Only ``*`` blocks have K/V rows; ``-`` and ``E`` are ``MLP_ONLY`` layers (neither K/V nor
state). Released checkpoints name the model ``backbone.`` and transformers 5 ``model.``;
both are read, with ``embeddings`` and ``norm_f`` as the decoder's ``embed_tokens`` and
``norm``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    Placement,
    RowParallelLinear,
    Shard,
    split_rows,
)
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.layers.mamba2 import Mamba2Spec
from radixlm.runtime.executor.layers.norm import RMSNorm
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding
from radixlm.runtime.executor.models.decoder import DecoderForCausalLM, DecoderSpec
from radixlm.runtime.executor.models.mamba_hybrid import (
    KVAttention,
    Mamba2Layer,
    dt_limit_of,
    mamba2_state_specs,
)
from radixlm.runtime.model_config import ModelConfig, nemotron_h_blocks


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class Relu2MLP(nn.Module):
    """``down_proj(relu(up_proj(x))^2)``: Nemotron-H's MLP blocks and shared expert (split
    over ranks like the dense MLP)."""

    def __init__(self, hidden: int, inter: int, bias: bool, what: str) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(
            hidden, {"up_proj": split_rows(inter, get_tp_group(), what)}, bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """Routed relu^2 experts (stacked: ``experts.up_proj`` [E, I, L], ``down_proj``
    [E, L, I], L the latent size or hidden) plus a shared expert. Routing in float32:
    ``s = sigmoid(x @ gate.T)``; experts chosen by ``s + e_score_correction_bias`` within the
    ``topk_group`` best of ``n_group`` groups (a group scores its two best); weights are the
    chosen ``s``, renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``.

    Under tensor parallelism each rank holds every expert's share of its intermediate rows
    (``layers/moe.py``'s split); the router and the latent projections are whole, and the
    experts' partial outputs are all-reduced before ``fc2_latent_proj``."""

    def __init__(self, hf: dict, hidden: int) -> None:
        super().__init__()
        self.tp = tp = get_tp_group()
        self.num_experts, self.top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
        self.n_group, self.topk_group = hf.get("n_group", 1), hf.get("topk_group", 1)
        self.renormalize = bool(hf.get("norm_topk_prob", True))
        self.scaling = float(hf.get("routed_scaling_factor", 1.0))
        inter, latent = hf["moe_intermediate_size"], hf.get("moe_latent_size") or hidden
        bias = bool(hf.get("mlp_bias", False))
        self.shard = split_rows(inter, tp, "moe_intermediate_size")
        inter = self.shard.size  # this rank's
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(self.num_experts, hidden))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.zeros(self.num_experts, inter, latent))
        self.experts.down_proj = nn.Parameter(torch.zeros(self.num_experts, latent, inter))
        self.shared_experts = Relu2MLP(hidden, hf["moe_shared_expert_intermediate_size"], bias,
                                       "moe_shared_expert_intermediate_size")
        self.latent = latent != hidden
        if self.latent:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, K] float32, expert ids [N, K])."""
        scores = (x.float() @ self.gate.weight.float().T).sigmoid()  # [N, E]
        choice = scores + self.gate.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, self.num_experts // self.n_group)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], 1),
                                        float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert over its tokens (one matmul pair per expert hit)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, k = (ids == e).nonzero(as_tuple=True)
            h = relu2(x[token] @ self.experts.up_proj[e].T) @ self.experts.down_proj[e].T
            out.index_add_(0, token, (h * weights[token, k, None]).to(x.dtype))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        h = self.fc1_latent_proj(x) if self.latent else x
        h = self.tp.all_reduce(self.experts_forward(h, weights, ids))
        if self.latent:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        """The checkpoint's per-expert ``experts.{e}.up_proj.weight`` / ``down_proj.weight``
        (this rank's rows of up, columns of down) into the stacked parameters."""
        out = {f"{prefix}.{n}": Placement(f"{prefix}.{n}") for n, _ in self.named_parameters()
               if not n.startswith(("experts.", "shared_experts."))}
        rows, cols = self.shard, Shard(1, self.shard.start, self.shard.stop, self.shard.full)
        for e in range(self.num_experts):
            for proj, shard in (("up_proj", rows), ("down_proj", cols)):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = Placement(
                    f"{prefix}.experts.{proj}", e, shard)
        return out


def _field(hf: dict, name: str, legacy: str, default: Any) -> Any:
    """A mixer field under its name or the older ``mamba_*`` one some released files use."""
    return hf[name] if name in hf else hf.get(legacy, default)


def mamba2_spec(hf: dict) -> Mamba2Spec:
    limit = _field(hf, "time_step_limit", "mamba_dt_limit", None)
    return Mamba2Spec(num_heads=hf["mamba_num_heads"], head_dim=hf["mamba_head_dim"],
                      n_groups=_field(hf, "n_groups", "mamba_n_groups", 8),
                      d_state=hf["ssm_state_size"],
                      chunk_size=_field(hf, "chunk_size", "mamba_chunk_size", 128),
                      dt_limit=dt_limit_of({"time_step_limit": limit}),
                      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                      activation=hf.get("mamba_hidden_act", "silu"))


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))`` with one mixer of the four kinds (module doc)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        hf = config.hf_config
        self.kind = nemotron_h_blocks(hf)[layer_id]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == "linear_attention":
            self.mixer: nn.Module = Mamba2Layer(
                config.hidden_size, mamba2_spec(hf), layer_id,
                _field(hf, "conv_kernel", "mamba_d_conv", 4),
                bool(_field(hf, "use_conv_bias", "mamba_conv_bias", True)),
                bool(hf.get("use_bias", False)))
        elif self.kind == "full_attention":
            self.mixer = KVAttention(config, spec, layer_id)
        elif self.kind == "mlp":
            self.mixer = Relu2MLP(config.hidden_size, config.intermediate_size,
                                  config.mlp_bias, "intermediate_size")
        else:
            self.mixer = NemotronHMoE(hf, config.hidden_size)

    def forward(self, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False):
        """``(out, residual)`` as ``DecoderLayer``; ``last_rows``: of only the rows of
        ``fb.logits_indices`` (attention and Mamba2 still run every row: K/V and state)."""
        b = fb.attention_backend
        if residual is None:
            residual, x = x, self.norm(x, backend=b)
        else:
            x, residual = self.norm(x, residual, backend=b)
        if last_rows:
            residual = residual[fb.logits_indices]
        if self.kind == "full_attention":
            return self.mixer(x, fb, None, last_rows), residual
        if self.kind == "linear_attention":
            x = self.mixer(x, fb)
            return (x[fb.logits_indices] if last_rows else x), residual
        return self.mixer(x[fb.logits_indices] if last_rows else x), residual


class NemotronHForCausalLM(DecoderForCausalLM):
    layer_class = NemotronHBlock

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        # no RoPE anywhere: the attention blocks have no positional encoding
        return replace(DecoderSpec(), rope_layers=(False,) * config.num_layers)

    # its Mamba2 layers write ``StateIndices.saves`` (snapshots inside an extend)
    inner_state_snapshots = True

    def state_specs(self) -> dict[int, StateSpec]:
        return mamba2_state_specs(self.model.layers, "mixer")

    def canonical_checkpoint_name(self, name: str) -> str | None:
        """Released files' ``backbone.`` and transformers' ``model.``, ``embeddings`` and
        ``norm_f`` as the decoder names them; multi-token-prediction layers not loaded."""
        if name.startswith("mtp."):
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        for theirs, ours in (("model.embeddings.", "model.embed_tokens."),
                             ("model.norm_f.", "model.norm.")):
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name
