"""The gated MLP's activations on ``cat(gate, up)`` [N, 2I] -> [N, I], by config.json's
``hidden_act`` / ``hidden_activation`` name; gpt-oss's experts hold gate and up
interleaved (``[g0, u0, g1, u1, ...]``) and clamp them (``gpt_oss_swiglu``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm import kernels


def silu_and_mul(x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (Llama, Qwen, Mistral, Phi-3, OLMo 2, SmolLM3, Granite)."""
    return kernels.silu_and_mul(x, backend=backend)


def gelu_tanh_and_mul(x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gpt_oss_swiglu(x: torch.Tensor, backend: str | None = None, alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's experts on interleaved ``gate``/``up`` columns: the gate clamped above at
    ``limit``, up to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


ACT_AND_MUL: dict[str, Callable[..., torch.Tensor]] = {
    "silu": silu_and_mul,
    "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
    "gpt_oss_swiglu": gpt_oss_swiglu,  # takes alpha and limit (swiglu_alpha / swiglu_limit)
}


def act_and_mul(name: str, **params: float) -> Callable[..., torch.Tensor]:
    """The activation for ``name`` (with ``params``, e.g. gpt-oss's ``alpha`` and
    ``limit``); ValueError naming the supported ones otherwise."""
    if name not in ACT_AND_MUL:
        raise ValueError(f"unsupported hidden activation {name!r} in config.json; "
                         f"supported: {', '.join(ACT_AND_MUL)}")
    return functools.partial(ACT_AND_MUL[name], **params) if params else ACT_AND_MUL[name]
