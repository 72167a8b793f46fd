"""Top ops by self time in a torch profiler trace (Chrome JSON, ``.json`` or ``.json.gz``),
e.g. the one ``--profile-dir`` has vLLM's CPU worker write.

    python benchmarks/vllm_side/profile_summary.py DIR_OR_TRACE [--top 25]

Self time: an op's duration less that of the ops nested directly inside it, per thread.
Ops are grouped by name (and input shapes with ``--shapes``, when the trace recorded them);
numbers in annotations (vLLM labels every step) are folded into one row.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

OP_CATEGORIES = ("cpu_op", "user_annotation", "kernel", "cpu_instant_event")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
            and e.get("cat") in OP_CATEGORIES and "dur" in e]


def self_times(events: list[dict], shapes: bool = False) -> dict[str, float]:
    """Microseconds of self time per op name (per name and input shapes with ``shapes``)."""
    totals: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, key, child time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]:
                end, key, child = stack.pop()
                totals[key] -= child
            key = e["name"]
            if e.get("cat") == "user_annotation":  # per-step labels: one row for all steps
                key = re.sub(r"\d+", "N", key)
            if shapes and e.get("args", {}).get("Input Dims"):
                key += " " + json.dumps(e["args"]["Input Dims"])
            totals[key] += e["dur"]
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], key, 0.0])
        while stack:
            _, key, child = stack.pop()
            totals[key] -= child
    return dict(totals)


def top_table(totals: dict[str, float], top: int) -> str:
    whole = sum(v for v in totals.values() if v > 0) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    lines = ["| op | self ms | % |", "|---|---|---|"]
    lines += [f"| `{k[:140]}` | {v / 1e3:.1f} | {100 * v / whole:.1f}% |" for k, v in rows]
    return "\n".join(lines)


def traces_in(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz"))
                  and "pt.trace" in p.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--shapes", action="store_true", help="group by input shapes too")
    args = ap.parse_args()
    for trace in traces_in(args.path):
        print(f"\n{trace}\n\n" + top_table(self_times(load_events(trace), args.shapes),
                                            args.top))


if __name__ == "__main__":
    main()
