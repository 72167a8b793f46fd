"""Llama (and Mistral) for the engine: packed tokens in, logits of the selected rows out.

    embed -> N x [RMSNorm -> attention -> RMSNorm -> SiLU-gated MLP] -> RMSNorm -> lm_head

Each RMSNorm after the first fuses the residual add (``rms_norm(x, w, eps, residual)``).
Attention writes this step's K/V into the paged pool, then reads the whole context back
through ``fb.kv_indices`` (see ``radixlm/runtime/executor/forward_batch.py``). Parameter names
match Hugging Face's, except that q/k/v and gate/up are each one matmul
(``checkpoint_layout`` says which checkpoint tensor fills which rows).

Under tensor parallelism (``radixlm/runtime/distributed/layers.py``) each rank holds its
attention heads, KV heads and share of the MLP; o_proj and down_proj end in one all-reduce
each, and rank 0 alone receives the logits. At tp_size 1 the layers are plain torch ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixlm import kernels
from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Placement,
    RowParallelLinear,
    VocabParallelEmbedding,
    gate_up_shards,
    local_kv_heads,
    qkv_shards,
)
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim / 2] float32
    """Inverse RoPE frequencies, computed as transformers does for default/linear/llama3."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq)


def rope_cos_sin_cache(config: ModelConfig) -> torch.Tensor:  # [context, head_dim] float32
    """``cat(cos, sin)`` of every position: the layout ``kernels.apply_rotary`` takes.
    Computed on the CPU (like transformers' inv_freq), whatever the default device."""
    positions = torch.arange(config.context_length, dtype=torch.int64, device="cpu").float()
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]  # [context, head_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None, backend=None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        return kernels.rms_norm(x, self.weight, self.eps, residual, backend=backend)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_kv_heads = local_kv_heads(config, tp.size)
        self.head_dim = config.head_dim
        self.sm_scale = config.sm_scale
        hidden = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul (checkpoints keep them apart: see checkpoint_layout)
        self.qkv_proj = ColumnParallelLinear(hidden, qkv_shards(config, tp), config.qkv_bias)
        self.o_proj = RowParallelLinear(config.q_size, hidden, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos_sin: torch.Tensor) -> torch.Tensor:
        n, backend = x.shape[0], fb.attention_backend
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = kernels.apply_rotary(q, k, cos_sin, fb.positions, backend=backend)
        k_buf, v_buf = fb.kv_pool.get_kv_buffer(self.layer_id)
        kernels.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v, backend=backend)
        scale = self.sm_scale
        if fb.mode.is_decode:  # kv_indices already include the new token's slot
            o = kernels.decode_attention(
                q, k_buf, v_buf, fb.kv_indptr, fb.kv_indices, scale, backend=backend,
                plan=fb.attention_plan, layout=fb.layout,
            )
        else:  # cached prefix from the pool, new tokens causally from k/v
            ragged = (fb.qo_indptr, fb.kv_indptr, fb.kv_indices)
            o = kernels.extend_attention(
                q, k, v, k_buf, v_buf, *ragged, scale, backend=backend,
                plan=fb.attention_plan, layout=fb.layout,
            )
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        # gate and up, one matmul
        self.gate_up_proj = ColumnParallelLinear(hidden, gate_up_shards(config, get_tp_group()),
                                                 bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x), backend=backend))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, residual, fb: ForwardBatch, cos_sin: torch.Tensor):
        """Returns ``(mlp_out, residual)``; the next norm adds them."""
        backend = fb.attention_backend
        if residual is None:
            residual, x = x, self.input_layernorm(x, backend=backend)
        else:
            x, residual = self.input_layernorm(x, residual, backend=backend)
        x = self.self_attn(x, fb, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual, backend=backend)
        return self.mlp(x, backend), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over the paged KV pool; ``forward(fb)`` returns float32 logits
    ``[len(fb.logits_indices), vocab]`` (on ranks other than 0 of a tensor-parallel group:
    ``[len(fb.logits_indices), 0]``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Always float32, whatever the weights' dtype: positions up to the context length
        # need the precision. Not a parameter, so `load_weights` never expects it.
        cos_sin = rope_cos_sin_cache(config).to(self.lm_head.weight.device)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

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
        return self.lm_head(self.hidden_states(fb)).float()  # [M, vocab]

    @torch.no_grad()
    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        """The final norm's output ``[len(fb.logits_indices), hidden]`` (transformers'
        ``last_hidden_state`` rows): what the LM head reads, and what embedding models
        pool (``--is-embedding``)."""
        x = self.model.embed_tokens(fb.input_ids)  # [N, hidden]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, fb, self.cos_sin_cache)
        # Norm only the rows that are wanted.
        x, _ = self.model.norm(
            x[fb.logits_indices], residual[fb.logits_indices], backend=fb.attention_backend
        )
        return x

    def _apply(self, fn, recurse=True):
        # Keep the RoPE table in float32 when the module is cast (`model.half()` etc.).
        cache = self.cos_sin_cache
        out = super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return out
