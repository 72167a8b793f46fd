"""One benchmark request as sent (``RequestInput``) and as measured (``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestInput:
    """What a backend sends: ``prompt`` for completion-style APIs, ``messages`` for chat."""

    prompt: str
    messages: list[dict[str, str]]
    output_len: int
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """Timings in seconds from the moment the request was sent.

    ``ttft``: until the first output token; ``itl``: the gaps between later tokens (a chunk
    carrying k tokens adds k equal gaps); ``latency``: until the stream ended (E2E).
    ``prompt_len`` / ``output_len`` / ``cached_tokens`` are the server's figures where it
    reports them (``cached_tokens`` is None when it does not)."""

    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for single-token outputs)."""
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)
