"""Qwen3-Next and Qwen3.5 (dense): hybrids of Gated DeltaNet layers and gated attention.

``layer_types`` interleaves ``linear_attention`` (three of four layers in the released
checkpoints) with ``full_attention``; every layer then has the same MLP, with Gemma's
``(1 + w)`` RMSNorms before the mixer and before the MLP::

    linear_attention   x -> in_proj -> q k v | z | b a
                       q k v -> causal conv1d (state: last K - 1 inputs) -> SiLU
                       -> gated delta rule (state: [Hv, Dk, Dv] per sequence, float32)
                       -> RMSNorm(o) * SiLU(z) per head -> out_proj
    full_attention     q_proj gives q and a gate per head; q/k RMSNorm per head, partial
                       RoPE (``partial_rotary_factor``), paged attention; o * sigmoid(gate)
                       -> o_proj

The linear layers' state of each running request lives in its slot of the state pool
(``radix_cache/state_pool.py``, ``ForwardBatch.state``): an extend continues its sequences
from their slots' states (zeros for a sequence with nothing computed) with the chunked rule,
a decode steps each by one token; both write the new state back. Only the attention layers
have K/V rows (``ModelConfig.kv_layer_index``). The math is ``layers/gated_delta.py``.

The two families differ in the linear layers' checkpoint tensors: Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` are grouped by key head (each key head's q, k, then its
value heads' v and z; its value heads' b, then a), Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` are plain concatenations. Qwen3.5's multimodal RoPE is plain
RoPE for text (its three position ids are equal). Here each family's projections are one
matmul (``in_proj``). Released Qwen3.5 checkpoints are vision-language models
(``Qwen3_5ForConditionalGeneration``): their language model is served.

With experts (Qwen3-Next as released, Qwen3.5-MoE), a sparse layer's MLP is ``layers/moe.py``'s
routed experts plus a shared expert every token takes, scaled by ``sigmoid(x @
shared_expert_gate)``; Qwen3-Next's sparse layers and ``norm_topk_prob`` as Qwen3-MoE's,
Qwen3.5-MoE's every layer, always renormalized.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from radixlm.kernels import state_step
from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    Placement,
    RowParallelLinear,
    local_kv_heads,
    qkv_shards,
    section_shards,
    sliced_placement,
    split_rows,
)
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch, StateIndices
from radixlm.runtime.executor.layers.activation import act_and_mul
from radixlm.runtime.executor.layers.attention import RadixAttention
from radixlm.runtime.executor.layers.gated_delta import (
    chunk_gated_delta_rule,
    gated_delta_gates,
    recurrent_gated_delta_rule_step,
    rms_norm_gated,
)
from radixlm.runtime.executor.layers.moe import MoESpec, Router, SparseMoeBlock, num_experts_of
from radixlm.runtime.executor.layers.norm import RMSNorm, norm_heads
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding
from radixlm.runtime.executor.layers.short_conv import (
    causal_conv1d,
    causal_conv1d_step,
    conv_in_pool,
)
from radixlm.runtime.executor.models.decoder import MLP, DecoderForCausalLM, DecoderSpec
from radixlm.runtime.executor.models.qwen3_moe import sparse_layers
from radixlm.runtime.model_config import LINEAR, ModelConfig


class GatedAttention(nn.Module):
    """Full attention whose q projection also gives a gate per head: ``o * sigmoid(gate)``
    before ``o_proj``. Split over ranks as the dense attention (``qkv_shards``): q_proj's
    rows of this rank's heads (each head's q and gate are adjacent)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_kv_heads = local_kv_heads(config, tp.size)
        self.head_dim = d = config.head_dim
        bias = config.attention_bias
        # q_proj's rows: per head, its q then its gate
        self.sizes = [2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        parts = qkv_shards(config, tp)
        parts["q_proj"] = split_rows(2 * config.q_size, tp, "q_proj's rows")
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, bias)
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, spec.norm_offset)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, spec.norm_offset)
        self.attn = RadixAttention(config.kv_layer_index(layer_id), self.num_heads,
                                   self.num_kv_heads, d, config.sm_scale, None)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rotary: RotaryEmbedding,
                last_rows: bool = False) -> torch.Tensor:
        n, d, b = x.shape[0], self.head_dim, fb.attention_backend
        qg, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        qg = qg.view(n, self.num_heads, 2 * d)
        q, gate = qg[..., :d].contiguous(), qg[..., d:].reshape(n, self.num_heads * d)
        q = norm_heads(self.q_norm, q, b)  # [N, Hq, D]
        k = norm_heads(self.k_norm, k.reshape(n, self.num_kv_heads, d), b)  # [N, Hkv, D]
        q, k = rotary(q, k, fb.positions, backend=b)
        o = self.attn(q, k, v.reshape(n, self.num_kv_heads, d), fb, last_rows)
        if last_rows:
            gate = gate[fb.logits_indices]
            if not o.shape[0]:  # no row wanted: only the K/V was owed
                return x[:0]
        return self.o_proj(o * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over packed sequences, its state in the state pool.

    Under tensor parallelism each rank holds ``1 / tp_size`` of the key heads and their value
    heads (as SGLang splits it): their rows of q, k, v, z, b and a, their conv channels,
    ``A_log`` and ``dt_bias``; ``out_proj`` is row-parallel (one all-reduce). Qwen3-Next's
    tensors grouped by key head give a rank one run of rows of each; Qwen3.5's
    ``in_proj_qkv`` three (its q, k and v sections). Its state is of its own heads."""

    def __init__(self, config: ModelConfig, layer_id: int, grouped: bool) -> None:
        super().__init__()
        hf, tp = config.hf_config, get_tp_group()
        self.layer_id = layer_id
        hk, hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        if hk % tp.size:
            raise ValueError(f"linear_num_key_heads ({hk}) is not divisible by tp_size "
                             f"({tp.size})")
        self.hk, self.hv = hk // tp.size, hv // tp.size  # this rank's heads
        self.dk, self.dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        self.kernel = hf.get("linear_conv_kernel_dim", 4)
        self.activation = hf.get("hidden_act", "silu")
        self.eps = config.rms_norm_eps
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.grouped = grouped  # Qwen3-Next's tensors grouped by key head (module doc)
        key, value = hk * self.dk, hv * self.dv  # every rank's
        self.conv_shards = section_shards([key, key, value], tp)  # q | k | v channels
        self.head_shard = section_shards([hv], tp)[0]
        parts = ({"in_proj_qkvz": section_shards([2 * key + 2 * value], tp),
                  "in_proj_ba": section_shards([2 * hv], tp)}
                 if grouped else {"in_proj_qkv": self.conv_shards,
                                  "in_proj_z": section_shards([value], tp),
                                  "in_proj_b": self.head_shard, "in_proj_a": self.head_shard})
        self.in_proj = ColumnParallelLinear(config.hidden_size, parts, False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.out_proj = RowParallelLinear(value, config.hidden_size, False)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        """This rank's conv channels and heads (the projections say their own)."""
        conv = f"{prefix}.conv1d.weight"
        layout = {conv: sliced_placement(conv, self.conv_shards),
                  f"{prefix}.norm.weight": Placement(f"{prefix}.norm.weight")}
        for name in ("A_log", "dt_bias"):
            layout[f"{prefix}.{name}"] = Placement(f"{prefix}.{name}", None, self.head_shard)
        return layout

    def state_spec(self) -> StateSpec:
        return StateSpec(self.conv_dim, self.kernel - 1, (self.hv, self.dk, self.dv))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> (qkv [T, conv_dim] as q | k | v, z [T, Hv, Dv], b, a [T, Hv])."""
        t, p = x.shape[0], self.in_proj(x)
        if not self.grouped:
            qkv, z, b, a = p.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
            return qkv, z.reshape(t, self.hv, self.dv), b, a
        r = self.hv // self.hk  # value heads per key head
        qkvz, ba = p.split([self.conv_dim + self.value_dim, 2 * self.hv], dim=-1)
        qkvz = qkvz.reshape(t, self.hk, 2 * self.dk + 2 * r * self.dv)  # by key head
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = ba.reshape(t, self.hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes the sequences' states."""
        st = fb.state
        assert st is not None, "a linear-attention layer needs ForwardBatch.state"
        t = x.shape[0]
        qkv, z, b, a = self._project(x)
        weight = self.conv1d.weight[:, 0]  # [C, K]
        if qkv.is_cuda and st.pool.ssm_dtype == torch.float32:
            o = self._in_pool_triton(qkv, weight, b, a, st, fb.mode.is_decode)
        elif fb.mode.is_decode and self._in_place(st, qkv, weight):
            o = self._decode_in_place(qkv, weight, b, a, st)
        else:
            o = self._gathered(qkv, weight, b, a, st, fb.mode.is_decode)
        o = rms_norm_gated(o, z, self.norm.weight, self.eps)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(t, self.value_dim))

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved [T, conv_dim] as q, k [T, Hk, Dk] and v [T, Hv, Dv]."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk),
                v.reshape(t, self.hv, self.dv))

    def _in_place(self, st: StateIndices, qkv: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a decode step can update the pool in place (``kernels/state_step``):
        CPU tensors the library takes, a float32 SSM pool, no fresh state to zero."""
        pool = st.pool
        return (pool.ssm_dtype == torch.float32 and (st.fresh is None or not st.fresh.any())
                and state_step.supports(qkv, weight, pool.conv[self.layer_id]))

    def _decode_in_place(self, qkv: torch.Tensor, weight: torch.Tensor, b: torch.Tensor,
                         a: torch.Tensor, st: StateIndices) -> torch.Tensor:
        """One token per sequence, its conv and SSM states read and written in the pool."""
        pool, slots = st.pool, st.slots
        qkv = state_step.conv1d_step(qkv, weight, None, pool.conv[self.layer_id], slots,
                                     self.activation)
        q, k, v = self._split(qkv)
        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        o = state_step.gated_delta_step(q, k, v, g, beta, pool.ssm[self.layer_id], slots)
        return o.to(q.dtype)  # as the torch step returns it

    def _in_pool_triton(self, qkv: torch.Tensor, weight: torch.Tensor, b: torch.Tensor,
                        a: torch.Tensor, st: StateIndices, decode: bool) -> torch.Tensor:
        """CUDA tensors (prefill and decode): the conv on gathered conv states (torch), the
        delta rule token by token on the SSM states where they lie in the pool, fresh ones
        zeroed and the snapshots written to their slots by the kernel
        (``kernels/gated_delta_triton``, imported on first use as ``radixlm.kernels`` does
        its Triton modules: importing it defines the kernel, and a CPU engine never pays)."""
        pool, layer = st.pool, self.layer_id
        qkv, snapshots = conv_in_pool(qkv, weight, None, self.activation, st, layer, decode)
        q, k, v = self._split(qkv)
        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        kernel = importlib.import_module("radixlm.kernels.gated_delta_triton")
        return kernel.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, pool.ssm[layer], st.slots, [1] * q.shape[0] if decode
            else st.seq_lens, fresh=st.fresh, snapshots=snapshots)

    def _gathered(self, qkv: torch.Tensor, weight: torch.Tensor, b: torch.Tensor,
                  a: torch.Tensor, st: StateIndices, decode: bool) -> torch.Tensor:
        """The sequences' states gathered from the pool, stepped or run over their chunks
        (with the radix cache's snapshots inside them), and scattered back."""
        conv_state, ssm = st.pool.read(self.layer_id, st.slots, st.fresh)
        conv_snaps = ssm_snaps = None  # the radix cache's snapshots inside the sequences
        if decode:
            qkv, conv_state = causal_conv1d_step(qkv, weight, None, conv_state, self.activation)
        else:
            qkv, conv_state, conv_snaps = causal_conv1d(qkv, weight, None, conv_state,
                                                        st.seq_lens, self.activation, st.saves)
        q, k, v = self._split(qkv)
        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        if decode:
            o, ssm = recurrent_gated_delta_rule_step(q, k, v, g, beta, ssm)
        else:
            o, ssm, ssm_snaps = chunk_gated_delta_rule(q, k, v, g, beta, ssm, st.seq_lens,
                                                       snapshots=st.saves)
        st.pool.write(self.layer_id, st.slots, conv_state, ssm)
        if conv_snaps is not None and ssm_snaps is not None and st.save_slots is not None:
            st.pool.write(self.layer_id, st.save_slots, conv_snaps, ssm_snaps)
        return o


class SharedExpertMLP(nn.Module):
    """The shared expert: a gated MLP of its own intermediate size (``shared_expert.``)."""

    def __init__(self, hidden: int, inter: int, activation: str) -> None:
        super().__init__()
        part = split_rows(inter, get_tp_group(), "shared_expert_intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden, {"gate_proj": part, "up_proj": part},
                                                 False)
        self.down_proj = RowParallelLinear(inter, hidden, False)
        self.act_and_mul = act_and_mul(activation)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x), backend=backend))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a shared expert every token takes, scaled by a sigmoid gate:
    ``experts(x) + sigmoid(x @ shared_expert_gate) * shared_expert(x)``. Under tensor
    parallelism the shared expert splits like the dense MLP; its gate is whole on every
    rank, like the router."""

    def __init__(self, hidden: int, spec: MoESpec, activation: str, shared_inter: int) -> None:
        super().__init__(hidden, spec, activation)
        self.shared_expert = SharedExpertMLP(hidden, shared_inter, activation)
        self.shared_expert_gate = Router(hidden, 1, bias=False)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        gate = f"{prefix}.shared_expert_gate.weight"
        return {**super().checkpoint_layout(prefix), gate: Placement(gate)}

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, backend)
        return super().forward(x, backend) + shared


@dataclass(frozen=True)
class SharedExpertBlock:
    """``DecoderSpec.moe_block`` of these families (a value: specs compare equal when the
    checkpoints' options do)."""

    shared_inter: int

    def __call__(self, hidden: int, spec: MoESpec, activation: str) -> SharedExpertMoeBlock:
        return SharedExpertMoeBlock(hidden, spec, activation, self.shared_inter)


class HybridDecoderLayer(nn.Module):
    """Pre-norm layer whose mixer is gated attention or a Gated DeltaNet."""

    grouped = True  # Qwen3-Next's linear-layer tensors

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.is_linear = config.layer_types[layer_id] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_id, self.grouped)
        else:
            self.self_attn = GatedAttention(config, spec, layer_id)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        if spec.moe is not None and spec.moe.is_sparse(layer_id):
            assert spec.moe_block is not None
            self.mlp: nn.Module = spec.moe_block(hidden, spec.moe, spec.activation)
        else:
            self.mlp = MLP(config, spec)

    def forward(self, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False):
        """Returns ``(out, residual)`` as ``DecoderLayer``; ``last_rows``: of only the rows
        of ``fb.logits_indices`` (a linear layer still runs every row: each one moves the
        state)."""
        b = fb.attention_backend
        if residual is None:
            residual, x = x, self.input_layernorm(x, backend=b)
        else:
            x, residual = self.input_layernorm(x, residual, backend=b)
        if self.is_linear:
            x = self.linear_attn(x, fb)
            if last_rows:
                x = x[fb.logits_indices]
        else:
            assert rotary is not None
            x = self.self_attn(x, fb, rotary, last_rows)
        if last_rows:
            residual = residual[fb.logits_indices]
            if not x.shape[0]:
                return x, residual
        x, residual = self.post_attention_layernorm(x, residual, backend=b)
        return self.mlp(x, b), residual


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    grouped = False


class Qwen3NextForCausalLM(DecoderForCausalLM):
    layer_class = HybridDecoderLayer

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        spec = DecoderSpec(norm_offset=1.0, qk_norm="head",
                           activation=hf.get("hidden_act", "silu"))
        if not num_experts_of(hf):  # dense
            return spec
        return replace(spec, moe=cls.moe_spec(config),
                       moe_block=SharedExpertBlock(hf["shared_expert_intermediate_size"]))

    @classmethod
    def moe_spec(cls, config: ModelConfig) -> MoESpec:
        """Qwen3-Next's routing: softmax, top k, renormalized when ``norm_topk_prob``, the
        weights rounded to the model dtype; sparse layers as Qwen3-MoE's."""
        hf = config.hf_config
        return MoESpec(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                       intermediate_size=hf["moe_intermediate_size"],
                       renormalize=bool(hf.get("norm_topk_prob", True)), weights_in_dtype=True,
                       sparse_layers=sparse_layers(hf, config.num_layers))

    # its linear layers write ``StateIndices.saves`` (snapshots inside an extend)
    inner_state_snapshots = True

    def state_specs(self) -> dict[int, StateSpec]:
        """Each linear layer's state of one sequence, by layer id (the state pool's
        layout)."""
        return {i: layer.linear_attn.state_spec() for i, layer in enumerate(self.model.layers)
                if layer.is_linear}


    def canonical_checkpoint_name(self, name: str) -> str | None:
        """The released checkpoints' multi-token-prediction layers (``mtp.``) are not
        loaded (no speculative decoding reads them)."""
        return None if name.startswith("mtp.") else name


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    layer_class = Qwen3_5DecoderLayer


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 checkpoint as released (a vision-language model),
    served text-only: config.json's ``text_config`` (``ModelConfig``), the tensors under
    ``model.language_model.`` and ``lm_head.``; the vision tower (``model.visual.``) and the
    MTP layers are not loaded."""

    _SKIPPED = ("model.visual.", "mtp.")

    def canonical_checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self._SKIPPED):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name  # lm_head., or not a language-model tensor (reported as unexpected)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: Qwen3.5 whose every layer's MLP is routed experts (always
    renormalized) and a shared expert."""

    @classmethod
    def moe_spec(cls, config: ModelConfig) -> MoESpec:
        return replace(super().moe_spec(config), renormalize=True, sparse_layers=None)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM,
                                         Qwen3_5ForConditionalGeneration):
    """Qwen3.5-MoE as released: a vision-language model whose language model is served."""
