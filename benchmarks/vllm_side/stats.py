"""Medians with min and max over rounds, and the markdown tables."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            raise ValueError("no values to summarize")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def cell(self, digits: int = 1) -> str:
        """``median (min-max)``; the median alone for one value."""
        m = f"{self.median:.{digits}f}"
        return m if self.n == 1 else f"{m} ({self.low:.{digits}f}-{self.high:.{digits}f})"

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def ratio(ours: Summary, theirs: Summary) -> str:
    """radixlm over vLLM, medians (higher is better for throughput)."""
    return f"{ours.median / theirs.median:.2f}x" if theirs.median > 0 else "-"


def round_ratios(ours: Sequence[float], theirs: Sequence[float]) -> Summary:
    """radixlm over vLLM round by round (the rounds alternate, so a round's pair ran
    minutes apart): a slow spell that hits one system's run shows as one outlying ratio
    instead of moving a median."""
    if len(ours) != len(theirs):
        raise ValueError("round_ratios: one figure per round from each system")
    return Summary.of([a / b for a, b in zip(ours, theirs, strict=True) if b > 0])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def token_match(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Share of output tokens equal position by position (a request's tokens after its
    first difference count as different: greedy decoding diverges from there)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += max(len(x), len(y))
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / total if total else 1.0
