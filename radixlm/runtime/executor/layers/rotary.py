"""Rotary position embedding: the inverse frequencies of each RoPE type, computed as
transformers computes them, and the module that rotates q and k.

    default   theta^(-2i/d)
    linear    default / factor
    llama3    low frequencies / factor, high ones kept, a smooth ramp between
    yarn      interpolation / extrapolation blended per dimension, cos/sin scaled by mscale
    longrope  default / short_factor[i] below original_max_position_embeddings, / long_factor[i]
              from there on (vLLM's split; transformers switches the whole sequence once it is
              longer, so beyond that length the two differ), cos/sin scaled

Partial rotary (Phi-4-mini, ``partial_rotary_factor``): the first ``rotary_dim`` of each
head's dims rotate, the rest pass through. Layers without RoPE (SmolLM3's NoPE layers) get
no ``RotaryEmbedding``. The cos/sin table is float32 whatever the model's dtype: positions
up to the context length need the precision.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixlm import kernels


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:  # [dim / 2] float32
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all
                            else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_factor(s: dict[str, Any], max_positions: int) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def cos_sin_table(theta: float, dim: int, scaling: dict[str, Any] | None, positions: int,
                  max_position_embeddings: int) -> torch.Tensor:  # [positions, dim] float32
    """``cat(cos, sin)`` of every position, times the type's attention factor (the layout
    ``kernels.apply_rotary`` takes)."""
    pos = torch.arange(positions, dtype=torch.int64, device="cpu").float()[:, None]
    rope_type = (scaling or {}).get("rope_type", "default")
    factor = 1.0
    if rope_type == "default":
        freqs = pos * default_inv_freq(theta, dim)[None, :]
    elif rope_type == "linear":
        freqs = pos * (default_inv_freq(theta, dim) / scaling["factor"])[None, :]
    elif rope_type == "llama3":
        freqs = pos * _llama3(default_inv_freq(theta, dim), scaling)[None, :]
    elif rope_type == "yarn":
        inv_freq, factor = _yarn(theta, dim, scaling)
        freqs = pos * inv_freq[None, :]
    elif rope_type == "longrope":
        powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)
        inv_freq = torch.where(pos < scaling["original_max_position_embeddings"], short, long)
        freqs, factor = pos * inv_freq, _longrope_factor(scaling, max_position_embeddings)
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return torch.cat((cos, sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE on the first ``rotary_dim`` dims of every q and k head."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float,
                 scaling: dict[str, Any] | None, positions: int,
                 max_position_embeddings: int) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim = {head_dim}], "
                             f"got {rotary_dim} (partial_rotary_factor)")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        table = cos_sin_table(theta, rotary_dim, scaling, positions, max_position_embeddings)
        # a buffer, not a parameter: load_weights never expects it
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D], k [N, Hkv, D] -> rotated copies."""
        if self.rotary_dim == self.head_dim:
            return kernels.apply_rotary(q, k, self.cos_sin_cache, positions, backend=backend)
        r = self.rotary_dim
        q_rot, k_rot = kernels.apply_rotary(q[..., :r], k[..., :r], self.cos_sin_cache,
                                            positions, backend=backend)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def _apply(self, fn, recurse=True):
        # Keep the table in float32 when the module is cast (`model.half()` etc.).
        cache = self.cos_sin_cache
        out = super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return out
