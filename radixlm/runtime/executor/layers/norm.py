"""RMSNorm as the families write it, over the fused ``radixlm.kernels.rms_norm``.

    Llama, Qwen, Mistral, Phi-3, OLMo 2, SmolLM3, Granite:  norm(x) * w
    Gemma 2 and 3:                                        norm(x) * (1 + w)   (w starts at 0)

Both multiply in float32 and round once (transformers' Gemma norm does the same; Llama's
rounds ``norm(x)`` to the input dtype first, which in float32 is the same thing). The
residual add is fused: ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``.
``norm_heads`` applies a norm of ``head_dim`` to every head of a ``[N, H, D]`` tensor
(Qwen 3's and Gemma 3's q/k norms); OLMo 2 norms the whole ``[N, H * D]`` projection
(``ShardedRMSNorm``: its heads are split over tensor-parallel ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm import kernels
from radixlm.runtime.distributed.layers import Placement, Shard
from radixlm.runtime.distributed.parallel_state import TpGroup


class RMSNorm(nn.Module):
    """``weight`` is the checkpoint's tensor; ``offset=1.0`` for Gemma's ``(1 + w)``."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def scale(self) -> torch.Tensor:  # [dim]: what norm(x) is multiplied by
        if self.offset == 0.0:
            return self.weight
        return self.weight.float() + self.offset  # float32, as Gemma's (1 + w.float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                backend: str | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        return kernels.rms_norm(x, self.scale(), self.eps, residual, backend=backend)


def norm_heads(norm: RMSNorm, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``norm`` (of size head_dim) on each head of ``x`` [N, H, D]."""
    n, h, d = x.shape
    return norm(x.reshape(n * h, d), backend=backend).view(n, h, d)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a vector split across tensor-parallel ranks (OLMo 2's q/k norm over every
    head): this rank holds ``shard`` of the weight and of x's last dim. The sum of squares
    is all-reduced, divided by how many ranks hold each element (KV heads replicated when
    there are fewer than ranks). At tp_size 1 it is ``RMSNorm``."""

    def __init__(self, full_dim: int, shard: Shard, eps: float, tp: TpGroup) -> None:
        super().__init__(shard.size, eps)
        self.full_dim, self.shard, self.tp = full_dim, shard, tp
        self.copies = tp.size * shard.size / full_dim

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                backend: str | None = None):
        assert residual is None, "a sharded norm has no fused residual add"
        if self.tp.size == 1:
            return super().forward(x, backend=backend)
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.copies
        out = xf * torch.rsqrt(squares / self.full_dim + self.eps) * self.weight.float()
        return out.to(x.dtype)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        return {f"{prefix}.weight": Placement(f"{prefix}.weight", None, self.shard)}
