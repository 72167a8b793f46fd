"""The gated MLP's activations on ``cat(gate, up)`` [N, 2I] -> [N, I], by config.json's
``hidden_act`` / ``hidden_activation`` name."""

from __future__ import annotations

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


ACT_AND_MUL: dict[str, Callable[..., torch.Tensor]] = {
    "silu": silu_and_mul,
    "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}


def act_and_mul(name: str) -> Callable[..., torch.Tensor]:
    """The activation for ``name``; ValueError naming the supported ones otherwise."""
    if name not in ACT_AND_MUL:
        raise ValueError(f"unsupported hidden activation {name!r} in config.json; "
                         f"supported: {', '.join(ACT_AND_MUL)}")
    return ACT_AND_MUL[name]
