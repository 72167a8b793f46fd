"""From the final hidden states to float32 logits: the lm_head, then Granite's
``logits_scaling`` (divide) and Gemma's ``final_logit_softcapping`` (``cap * tanh(x / cap)``),
in transformers' order."""

from __future__ import annotations

import torch
from torch import nn


class LogitsProcessor(nn.Module):
    def __init__(self, scaling: float | None = None, soft_cap: float | None = None) -> None:
        super().__init__()
        for name, value in (("logits_scaling", scaling), ("final_logit_softcapping", soft_cap)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} in config.json must be > 0, got {value!r}")
        self.scaling = scaling
        self.soft_cap = soft_cap

    def forward(self, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [M, hidden] -> [M, vocab] float32 (ranks other than 0 of a tensor-parallel
        group: [M, 0])."""
        logits = lm_head(x)
        if self.scaling is not None:
            logits = logits / self.scaling
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits.float()
