"""The results document (what ``--out`` holds) and its markdown tables.

Offline: ``results["offline"][dtype][workload][system]`` = {"tok_s": [...per round],
"seconds": [...], "output_tokens": [...], "valid": [...] (JSON workload)}, and
``...[workload]["token_match"]`` = [...per round]; ``results["probe"][dtype][system]`` =
{"before": [...], "after": [...]}, the machine probe's GFLOP/s around each of that system's
offline runs (warm-ups included). Served:
``results["served"][dtype][rate][system][metric]`` = [...per round].
"""

from __future__ import annotations

from vllm_side.stats import Summary, markdown_table, ratio, round_ratios

SERVED_METRICS = (("output_throughput", "out tok/s", 1), ("median_ttft_ms", "TTFT p50 ms", 0),
                  ("p99_ttft_ms", "TTFT p99 ms", 0), ("median_tpot_ms", "TPOT p50 ms", 1),
                  ("p99_tpot_ms", "TPOT p99 ms", 1))


def add_offline(results: dict, dtype: str, system: str, worker_out: dict,
                valid: dict[str, int]) -> None:
    """File one worker's round under ``results["offline"]``."""
    for name, r in worker_out["workloads"].items():
        row = results.setdefault("offline", {}).setdefault(dtype, {}).setdefault(name, {})
        runs = row.setdefault(system, {"tok_s": [], "seconds": [], "output_tokens": []})
        runs["tok_s"].append(r["output_tokens"] / r["seconds"])
        runs["seconds"].append(r["seconds"])
        runs["output_tokens"].append(r["output_tokens"])
        if name in valid:
            runs.setdefault("valid", []).append(valid[name])


def add_served(results: dict, dtype: str, system: str, per_rate: dict[str, dict]) -> None:
    for rate, record in per_rate.items():
        row = results.setdefault("served", {}).setdefault(dtype, {}).setdefault(rate, {})
        runs = row.setdefault(system, {})
        for key, value in record.items():
            runs.setdefault(key, []).append(value)


def _valid(runs: dict, requests: int | None) -> str:
    if "valid" not in runs:
        return ""
    low, high = min(runs["valid"]), max(runs["valid"])
    return (f"{low}" if low == high else f"{low}-{high}") + (f"/{requests}" if requests else "")


def offline_table(results: dict, json_requests: int | None = None) -> str:
    rows = []
    for dtype, workloads in results.get("offline", {}).items():
        for name, row in workloads.items():
            r, v = row.get("radixlm"), row.get("vllm")
            rs = Summary.of(r["tok_s"]) if r else None
            vs = Summary.of(v["tok_s"]) if v else None
            match = row.get("token_match")
            valid = " / ".join(x for x in (_valid(r or {}, json_requests),
                                           _valid(v or {}, json_requests)) if x)
            by_round = (round_ratios(r["tok_s"], v["tok_s"])
                        if r and v and len(r["tok_s"]) == len(v["tok_s"]) else None)
            rows.append([name, dtype, rs.cell() if rs else "-", vs.cell() if vs else "-",
                         ratio(rs, vs) if rs and vs else "-",
                         _ratio_cell(by_round) if by_round else "-",
                         f"{100 * Summary.of(match).median:.0f}%" if match else "-",
                         valid or "-"])
    return markdown_table(["workload", "dtype", "radixlm tok/s", "vLLM tok/s",
                           "ratio", "round by round", "same tokens",
                           "JSON valid (radixlm / vLLM)"], rows)


def _ratio_cell(s: Summary) -> str:
    """``median (min-max)`` of per-round ratios, as ratios."""
    return (f"{s.median:.2f}x" if s.n == 1
            else f"{s.median:.2f}x ({s.low:.2f}-{s.high:.2f})")


def add_probe(results: dict, dtype: str, system: str, before: float, after: float) -> None:
    """File the machine probes taken before and after one system's offline run."""
    runs = results.setdefault("probe", {}).setdefault(dtype, {}).setdefault(
        system, {"before": [], "after": []})
    runs["before"].append(before)
    runs["after"].append(after)


def probe_table(results: dict) -> str:
    """The machine probes around each system's runs (``vllm_side/probe.py``): GFLOP/s."""
    rows = [[dtype, "vLLM" if system == "vllm" else system,
             Summary.of(runs["before"]).cell(), Summary.of(runs["after"]).cell(),
             " ".join(f"{b:.0f}/{a:.0f}" for b, a in zip(runs["before"], runs["after"],
                                                          strict=True))]
            for dtype, systems in results.get("probe", {}).items()
            for system, runs in systems.items()]
    return markdown_table(["dtype", "system", "before", "after", "run by run (before/after)"],
                          rows)


def served_table(results: dict) -> str:
    rows = []
    for dtype, rates in results.get("served", {}).items():
        for rate, systems in rates.items():
            for system in ("radixlm", "vllm"):
                runs = systems.get(system)
                if not runs:
                    continue
                cells = [Summary.of([x for x in runs[k] if x is not None]).cell(d)
                         if any(x is not None for x in runs.get(k, [])) else "-"
                         for k, _, d in SERVED_METRICS]
                failed = sum(runs.get("failed", []) or [0])
                rows.append([dtype, rate, "vLLM" if system == "vllm" else system, *cells,
                             str(failed)])
    return markdown_table(["dtype", "req/s", "system", *(h for _, h, _ in SERVED_METRICS),
                           "failed"], rows)


def json_table(results: dict, requests: int) -> str:
    """The JSON workload by wall time: its output lengths differ between the systems (an
    object ends at EOS; an output that never closes runs to the cap), so tok/s alone can
    flatter the one that generates more."""
    rows = []
    for dtype, workloads in results.get("offline", {}).items():
        for system in ("radixlm", "vllm"):
            runs = workloads.get("json", {}).get(system)
            if not runs:
                continue
            per_s = [v / t for v, t in zip(runs["valid"], runs["seconds"], strict=True)]
            rows.append([dtype, "vLLM" if system == "vllm" else system,
                         Summary.of(runs["seconds"]).cell(2),
                         Summary.of(runs["output_tokens"]).cell(0),
                         _valid(runs, requests), Summary.of(per_s).cell(2)])
    return markdown_table(["dtype", "system", "seconds", "output tokens", "valid",
                           "valid objects/s"], rows)
