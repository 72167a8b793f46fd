"""PNG plots of benchmark runs (matplotlib's Agg canvas; no display, no pyplot state).

- ``latency_cdf.png``: the empirical CDFs of TTFT, TPOT, ITL and E2E, one line per run.
- ``rate_sweep.png`` (two or more finite request rates): output and request throughput
  (and goodput under ``--slo``), and p99 TTFT / TPOT / ITL / E2E, against the request rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from radixlm.bench.metrics import BenchMetrics
from radixlm.bench.request import RequestOutput


class Run(Protocol):
    request_rate: float
    outputs: list[RequestOutput]
    metrics: BenchMetrics


def _latencies_ms(outputs: Sequence[RequestOutput]) -> dict[str, list[float]]:
    done = [o for o in outputs if o.success]
    return {
        "TTFT": [o.ttft * 1000 for o in done],
        "TPOT": [t * 1000 for o in done if (t := o.tpot) is not None],
        "ITL": [g * 1000 for o in done for g in o.itl],
        "E2E": [o.latency * 1000 for o in done],
    }


def _label(rate: float) -> str:
    return "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=80)
    return path


def plot_latency_cdfs(runs: Sequence[Run], path: Path) -> Path:
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    per_run = [(_label(r.request_rate), _latencies_ms(r.outputs)) for r in runs]
    for ax, name in zip(axes, ("TTFT", "TPOT", "ITL", "E2E")):
        for label, lat in per_run:
            values = sorted(lat[name])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("Latency CDFs")
    return _save(fig, path)


def plot_rate_sweep(runs: Sequence[Run], path: Path) -> Path:
    finite = sorted((r for r in runs if not math.isinf(r.request_rate)),
                    key=lambda r: r.request_rate)
    rates = [r.request_rate for r in finite]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(rates, [r.metrics.output_throughput for r in finite], "o-",
              label="output tok/s")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("output throughput (tok/s)")
    twin = left.twinx()
    twin.plot(rates, [r.metrics.request_throughput for r in finite], "s--", color="tab:orange",
              label="completed req/s")
    if all(r.metrics.goodput is not None for r in finite):
        twin.plot(rates, [r.metrics.goodput.request_goodput for r in finite], "^:",
                  color="tab:green", label="goodput req/s")
    twin.set_ylabel("requests per second")
    left.legend(loc="upper left", fontsize="small")
    twin.legend(loc="lower right", fontsize="small")
    for name in ("ttft", "tpot", "itl", "e2e"):
        right.plot(rates, [getattr(r.metrics, name).p99 for r in finite], "o-",
                   label=f"p99 {name.upper()}")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("latency (ms)")
    right.set_yscale("log")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if rates[-1] / rates[0] >= 8:  # doubling sweeps read best on a log axis
            ax.set_xscale("log", base=2)
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.minorticks_off()
    left.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    fig.suptitle("Throughput and p99 latency against request rate")
    return _save(fig, path)


def write_plots(out_dir: Path, runs: Sequence[Run]) -> list[Path]:
    """The CDF plot always; the sweep plot when the runs have two or more finite rates."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdfs(runs, out_dir / "latency_cdf.png")]
    if sum(not math.isinf(r.request_rate) for r in runs) >= 2:
        paths.append(plot_rate_sweep(runs, out_dir / "rate_sweep.png"))
    return paths
