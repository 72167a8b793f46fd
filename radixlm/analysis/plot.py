"""The PNG of ``radixlm prefix-report --plot``: where consecutive prompts diverge."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def plot_divergence(report: dict[str, Any], path: str | Path, bins: int = 40) -> Path:
    """A histogram of divergence positions (tokens with a tokenizer, else characters),
    stacked by cause; written with matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = report["unit"]
    by_kind: dict[str, list[int]] = defaultdict(list)
    for d in report["divergence_positions"]:
        pos = d["tokens"] if unit == "tokens" else d["char"]
        by_kind[d["kind"]].append(pos)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if by_kind:
        kinds = sorted(by_kind, key=lambda k: -len(by_kind[k]))
        ax.hist([by_kind[k] for k in kinds], bins=bins, stacked=True, label=kinds)
        ax.legend(title="cause")
    else:
        ax.text(0.5, 0.5, "no consecutive prompts diverge", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel(f"divergence position ({unit})")
    ax.set_ylabel("consecutive request pairs")
    ax.set_title(f"Where prefixes stop matching ({report['requests']} requests, "
                 f"{report['families']} families)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
