"""The dense decoder every family file composes: packed tokens in, logits of the selected
rows out.

    embed (x scale) -> N x [norms around attention and MLP, per ``DecoderSpec.norms``]
                   -> RMSNorm -> lm_head -> logits processing

``DecoderSpec`` says what a family changes (norm layout and ``(1 + w)`` weights, q/k norms,
activation, multipliers, soft-caps, NoPE layers); ``ModelConfig`` gives the sizes, the RoPE
of each layer type and each layer's sliding window. Norm layouts, with ``+`` the residual:

    pre       x + attn(norm(x)),  then  x + mlp(norm(x))                 (Llama)
    sandwich  x + norm(attn(norm(x))),  then  x + norm(mlp(norm(x)))     (Gemma 2, 3)
    post      x + norm(attn(x)),  then  x + norm(mlp(x))                 (OLMo 2)

Layers return ``(out, residual)`` and the next norm adds them (``rms_norm`` fuses the add).
Parameter names match Hugging Face's, except that q/k/v and gate/up are each one matmul
(``checkpoint_layout`` says which checkpoint tensor fills which rows); a sparse layer's
MLP is ``layers/moe.py``'s router and stacked experts (``DecoderSpec.moe``). Under tensor
parallelism (``radixlm/runtime/distributed/layers.py``) each rank holds its attention
heads, KV heads and share of the MLP; o_proj and down_proj end in one all-reduce each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Placement,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    gate_up_shards,
    local_kv_heads,
    qkv_shards,
)
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.layers.activation import act_and_mul
from radixlm.runtime.executor.layers.attention import RadixAttention
from radixlm.runtime.executor.layers.logits import LogitsProcessor
from radixlm.runtime.executor.layers.moe import MoESpec, SparseMoeBlock
from radixlm.runtime.executor.layers.norm import RMSNorm, ShardedRMSNorm, norm_heads
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding
from radixlm.runtime.model_config import ModelConfig, rope_scaling_of, rope_theta_of

NORM_LAYOUTS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class DecoderSpec:
    """What a family changes in the dense decoder (defaults: Llama)."""

    norms: str = "pre"  # NORM_LAYOUTS
    norm_offset: float = 0.0  # 1.0: Gemma's (1 + w) norms, q/k norms included
    qk_norm: str | None = None  # "head": per head (Qwen 3, Gemma 3); "all": all heads (OLMo 2)
    activation: str = "silu"
    embed_scale: float | None = None  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_multiplier: float | None = None  # Granite: attn/MLP outputs scaled before the add
    sm_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_cap: float | None = None  # Gemma 2
    logits_scaling: float | None = None  # Granite: logits / logits_scaling
    final_logit_cap: float | None = None  # Gemma 2
    rope_layers: tuple[bool, ...] | None = None  # None: RoPE in every layer (SmolLM3: NoPE)
    moe: MoESpec | None = None  # mixture of experts in its sparse layers (Mixtral, Qwen3-MoE)
    # the sparse layers' block, built as (hidden, moe, activation); None: SparseMoeBlock
    # (gpt-oss: its checkpoint's stacked expert tensors)
    moe_block: Callable[[int, MoESpec, str], nn.Module] | None = None
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax

    def __post_init__(self) -> None:
        assert self.norms in NORM_LAYOUTS, self.norms
        assert self.qk_norm in (None, "head", "all"), self.qk_norm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_kv_heads = local_kv_heads(config, tp.size)
        self.head_dim = d = config.head_dim
        hidden = config.hidden_size
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # q, k and v in one matmul (checkpoints keep them apart: see checkpoint_layout)
        self.qkv_proj = ColumnParallelLinear(hidden, qkv_shards(config, tp), config.qkv_bias)
        self.o_proj = RowParallelLinear(config.q_size, hidden, bias=config.attention_bias)
        self.qk_norm = spec.qk_norm
        eps = config.rms_norm_eps
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(d, eps, spec.norm_offset)
            self.k_norm = RMSNorm(d, eps, spec.norm_offset)
        elif spec.qk_norm == "all":  # over every head: this rank's rows, squares all-reduced
            assert spec.norm_offset == 0.0, "no family has (1 + w) norms over all heads"
            shards = qkv_shards(config, tp)
            self.q_norm = ShardedRMSNorm(config.q_size, shards["q_proj"], eps, tp)
            self.k_norm = ShardedRMSNorm(config.kv_size, shards["k_proj"], eps, tp)
        sinks = (Shard(0, tp.rank * self.num_heads, (tp.rank + 1) * self.num_heads,
                       config.num_attention_heads) if spec.attn_sinks else None)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, d,
                                   spec.sm_scale or config.sm_scale,
                                   config.layer_window(layer_id), spec.attn_logit_cap, sinks)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False) -> torch.Tensor:
        """[N, hidden] -> [N, hidden]; ``last_rows``: [M, hidden], the rows of
        ``fb.logits_indices`` (every row's K/V still stored)."""
        n, backend = x.shape[0], fb.attention_backend
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "all":  # over the whole projection [N, H * D]
            q, k = self.q_norm(q, backend=backend), self.k_norm(k, backend=backend)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = norm_heads(self.q_norm, q, backend), norm_heads(self.k_norm, k, backend)
        if rotary is not None:
            q, k = rotary(q, k, fb.positions, backend=backend)
        o = self.attn(q, k, v, fb, last_rows)
        if last_rows and not o.shape[0]:  # no row wanted: only the K/V was owed
            return x[:0]
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        # gate and up, one matmul
        self.gate_up_proj = ColumnParallelLinear(hidden, gate_up_shards(config, get_tp_group()),
                                                 bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act_and_mul = act_and_mul(spec.activation)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x), backend=backend))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, spec.norm_offset
        self.norms = spec.norms
        self.residual_multiplier = spec.residual_multiplier
        if spec.norms != "post":
            self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.self_attn = Attention(config, spec, layer_id)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        if spec.norms == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        if spec.norms != "pre":
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        if spec.moe is not None and spec.moe.is_sparse(layer_id):
            block = spec.moe_block or SparseMoeBlock
            self.mlp: nn.Module = block(hidden, spec.moe, spec.activation)
        else:
            self.mlp = MLP(config, spec)

    def forward(self, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False):
        """Returns ``(out, residual)``; the next norm adds them. ``last_rows`` (the last
        layer of an extend with ``fb.last_rows``): both of only the rows of
        ``fb.logits_indices``, after every row's K/V went to the pool."""
        b = fb.attention_backend
        if self.norms == "post":  # OLMo 2: no norm before attention or the MLP
            h = x if residual is None else residual + x
            attn = self.self_attn(h, fb, rotary, last_rows)
            if last_rows:
                h = h[fb.logits_indices]
                if not attn.shape[0]:  # no row wanted: the K/V was all this layer owed
                    return attn, h
            h = h + self.post_attention_layernorm(attn, backend=b)
            return self.post_feedforward_layernorm(self.mlp(h, b), backend=b), h
        if residual is None:
            residual, x = x, self.input_layernorm(x, backend=b)
        else:
            x, residual = self.input_layernorm(x, residual, backend=b)
        x = self._scaled(self.self_attn(x, fb, rotary, last_rows))
        if last_rows:
            residual = residual[fb.logits_indices]
            if not x.shape[0]:
                return x, residual
        if self.norms == "pre":
            x, residual = self.post_attention_layernorm(x, residual, backend=b)
            return self._scaled(self.mlp(x, b)), residual
        x = self.post_attention_layernorm(x, backend=b)
        x, residual = self.pre_feedforward_layernorm(x, residual, backend=b)
        return self.post_feedforward_layernorm(self.mlp(x, b), backend=b), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier is None else x * self.residual_multiplier


def build_rotaries(config: ModelConfig, spec: DecoderSpec) -> nn.ModuleDict:
    """One RoPE table per layer type present (Gemma 3's sliding layers have their own base);
    two types with the same RoPE share one table."""
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    tables: dict[str, RotaryEmbedding] = {}
    made: dict[str, RotaryEmbedding] = {}
    for layer_type in dict.fromkeys(config.layer_types):
        theta = rope_theta_of(config.hf_config, layer_type)
        scaling = rope_scaling_of(config.hf_config, layer_type)
        key = repr((theta, scaling))
        if key not in made:
            made[key] = RotaryEmbedding(config.head_dim, rotary_dim, theta, scaling,
                                        config.context_length, config.max_position_embeddings)
        tables[layer_type] = made[key]
    return nn.ModuleDict(tables)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec,
                 layer_class: type[nn.Module] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, spec, i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, spec.norm_offset)
        self.rotary_emb = build_rotaries(config, spec)


class DecoderForCausalLM(nn.Module):
    """A dense causal LM over the paged KV pool; ``forward(fb)`` returns float32 logits
    ``[len(fb.logits_indices), vocab]`` (on ranks other than 0 of a tensor-parallel group:
    ``[len(fb.logits_indices), 0]``). A family sets ``spec_for``; a hybrid family its
    ``layer_class`` too (a layer with ``DecoderLayer``'s forward)."""

    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.spec = spec = self.spec_for(config)
        if spec.rope_layers is not None and len(spec.rope_layers) != config.num_layers:
            raise ValueError(f"{len(spec.rope_layers)} RoPE flags (no_rope_layers) for "
                             f"{config.num_layers} layers")
        self.model = DecoderModel(config, spec, self.layer_class)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(spec.logits_scaling, spec.final_logit_cap)

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec()

    def layer_rotary(self, layer_id: int) -> RotaryEmbedding | None:
        rope = self.spec.rope_layers
        if rope is not None and not rope[layer_id]:
            return None
        return self.model.rotary_emb[self.config.layer_types[layer_id]]

    def checkpoint_layout(self) -> dict[str, Placement]:
        """Checkpoint tensor name -> where it goes (parameter, its rows, this rank's slice of
        the tensor). Hugging Face keeps q/k/v and gate/up apart; here each group is one
        parameter. A tied lm_head is not listed: it is the embedding."""
        params = dict(self.named_parameters())
        layout = {name: Placement(name) for name in params}
        for prefix, module in self.named_modules():
            if hasattr(module, "checkpoint_layout") and module is not self:
                for param in module.state_dict(keep_vars=True):
                    layout.pop(f"{prefix}.{param}", None)
                layout.update(module.checkpoint_layout(prefix))
        return {name: place for name, place in layout.items() if place.param in params}

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.logits_processor(self.lm_head, self.hidden_states(fb))  # [M, vocab]

    @torch.no_grad()
    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        """The final norm's output ``[len(fb.logits_indices), hidden]`` (transformers'
        ``last_hidden_state`` rows): what the LM head reads, and what embedding models
        pool (``--is-embedding``)."""
        x = self.model.embed_tokens(fb.input_ids)  # [N, hidden]
        if self.spec.embed_scale is not None:  # rounded to the dtype first, as transformers
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        residual = None
        last = len(self.model.layers) - 1 if fb.last_rows is not None else -1
        for i, layer in enumerate(self.model.layers):
            # the last layer: every row's K/V, then the wanted rows alone (no one reads
            # the others' outputs)
            x, residual = layer(x, residual, fb, self.layer_rotary(i), i == last)
        if last < 0:  # norm only the rows that are wanted
            x, residual = x[fb.logits_indices], residual[fb.logits_indices]
        x, _ = self.model.norm(x, residual, backend=fb.attention_backend)
        return x
