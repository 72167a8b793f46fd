"""Figures from the workers' results, filed per round, and the markdown tables.

``results["offline"][model][format][metric][system]`` holds one figure per round (tokens per
second, higher is better); ``results["served"][model][format][rate][system]`` one record of
``radixlm bench serve`` per round.
"""

from __future__ import annotations

from vllm_side.stats import Summary, markdown_table, ratio, round_ratios, token_match

SYSTEMS = ("radixlm", "llamacpp")
NAMES = {"radixlm": "radixlm", "llamacpp": "llama.cpp"}
SERVED_KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
               "p99_tpot_ms", "failed")


def metrics(bench: dict) -> dict[str, float]:
    """A bench result's figures: the prompt's tokens per second (one stream, to its first
    token), decode tokens per second after it, and each N-stream run's output tokens per
    second (wall time from submission, prompts included)."""
    single = bench["single"]
    out = {"prompt tok/s": single["prompt_tokens"] / single["first_token_s"],
           "decode tok/s, 1 stream": (single["output_tokens"] - 1)
           / (single["seconds"] - single["first_token_s"])}
    for name, run in bench.items():
        if name.startswith("streams_"):
            out[f"{name.split('_')[1]} streams, output tok/s"] = (run["output_tokens"]
                                                                 / run["seconds"])
    return out


def add_offline(results: dict, model: str, fmt: str, system: str, bench: dict) -> None:
    per_metric = results.setdefault("offline", {}).setdefault(model, {}).setdefault(fmt, {})
    for metric, value in metrics(bench).items():
        per_metric.setdefault(metric, {}).setdefault(system, []).append(value)


def add_token_match(results: dict, model: str, fmt: str, benches: dict[str, dict]) -> None:
    """Share of greedy tokens equal up to each request's first difference, per job."""
    if set(benches) != set(SYSTEMS):
        return
    matches = results.setdefault("token_match", {}).setdefault(model, {}).setdefault(fmt, {})
    for job in benches["radixlm"]:
        a, b = (benches[s][job]["output_ids"] for s in SYSTEMS)
        matches.setdefault(job, []).append(token_match(a, b))


def add_served(results: dict, model: str, fmt: str, system: str,
               per_rate: dict[str, dict]) -> None:
    by_rate = results.setdefault("served", {}).setdefault(model, {}).setdefault(fmt, {})
    for rate, record in per_rate.items():
        by_rate.setdefault(rate, {}).setdefault(system, []).append(
            {k: record.get(k) for k in SERVED_KEYS})


def _cell(values: list[float] | None, digits: int = 1) -> str:
    return Summary.of(values).cell(digits) if values else "-"


def offline_table(results: dict, sizes: dict | None = None) -> str:
    """One row per model, format and metric: each system's median (min-max) and radixlm
    over llama.cpp (medians, and round by round)."""
    rows = []
    for model, formats in results.get("offline", {}).items():
        for fmt, per_metric in formats.items():
            size = (sizes or {}).get(model, {}).get(fmt)
            for metric, by_system in per_metric.items():
                ours, theirs = by_system.get("radixlm"), by_system.get("llamacpp")
                both = bool(ours and theirs and len(ours) == len(theirs))
                rows.append([model, fmt, f"{size / 2**20:.0f}" if size else "-", metric,
                             _cell(ours), _cell(theirs),
                             ratio(Summary.of(ours), Summary.of(theirs)) if both else "-",
                             round_ratios(ours, theirs).cell(2) + "x" if both else "-"])
    return markdown_table(["model", "format", "file MiB", "metric", "radixlm", "llama.cpp",
                           "ratio", "round by round"], rows)


def served_table(results: dict) -> str:
    """One row per model, format, rate and system: medians over rounds."""
    rows = []
    for model, formats in results.get("served", {}).items():
        for fmt, by_rate in formats.items():
            for rate, by_system in by_rate.items():
                for system in SYSTEMS:
                    records = by_system.get(system)
                    if not records:
                        continue
                    cells = [_cell([r[k] for r in records if r.get(k) is not None],
                                   0 if "ttft" in k else 1) for k in SERVED_KEYS[:-1]]
                    failed = max(r.get("failed") or 0 for r in records)
                    rows.append([model, fmt, rate, NAMES[system], *cells, str(failed)])
    return markdown_table(["model", "format", "req/s", "system", "output tok/s",
                           "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                           "failed"], rows)


def match_table(results: dict) -> str:
    rows = [[model, fmt, job, _cell([100 * m for m in values], 0) + "%"]
            for model, formats in results.get("token_match", {}).items()
            for fmt, jobs in formats.items() for job, values in jobs.items()]
    return markdown_table(["model", "format", "run", "greedy tokens equal to the first "
                           "difference"], rows)


def greedy_agreement(theirs: dict, ours: list[list[int]], bound: float
                     ) -> tuple[int, list[str]]:
    """radixlm's greedy tokens against llama.cpp's (``llama_worker``'s ``greedy`` result,
    its ``near`` taken with ``bound``), each prompt up to its first difference: there the
    prefixes part, so nothing after it is compared. That difference is allowed only where
    llama.cpp's top-2 margin is at most ``bound`` and our token is one of its tokens within
    ``bound`` of the top. Returns (tokens equal before the first differences, problems)."""
    equal, problems = 0, []
    for i, (ids, margins, near, mine) in enumerate(zip(
            theirs["output_ids"], theirs["margins"], theirs["near"], ours, strict=True)):
        if len(mine) != len(ids):
            problems.append(f"prompt {i}: {len(mine)} tokens, llama.cpp {len(ids)}")
        for k, (a, b) in enumerate(zip(ids, mine)):
            if a == b:
                equal += 1
                continue
            if margins[k] > bound or b not in near[k]:
                problems.append(f"prompt {i} token {k}: radixlm {b}, llama.cpp {a} with a "
                                f"margin of {margins[k]:.2f} (bound {bound}; within it: "
                                f"{near[k]})")
            break
    return equal, problems


def add_tokens(results: dict, model: str, fmt: str, theirs: dict, ours: list[list[int]],
               bound: float) -> None:
    """A greedy comparison's figures: tokens equal before the first differences, llama.cpp's
    margin at each first difference, and the differences beyond ``bound``."""
    equal, problems = greedy_agreement(theirs, ours, bound)
    firsts = [round(margins[k], 2) for ids, margins, mine in zip(
        theirs["output_ids"], theirs["margins"], ours) for k, (a, b) in enumerate(zip(ids, mine))
        if a != b and ids[:k] == mine[:k]]
    results.setdefault("tokens", {}).setdefault(model, {})[fmt] = {
        "equal": equal, "of": sum(map(len, theirs["output_ids"])), "bound": bound,
        "first_difference_margins": firsts, "problems": problems}


def tokens_table(results: dict) -> str:
    rows = [[model, fmt, f"{t['equal']}/{t['of']}",
             ", ".join(f"{m:.2f}" for m in t["first_difference_margins"]) or "-",
             str(len(t["problems"]))]
            for model, formats in results.get("tokens", {}).items()
            for fmt, t in formats.items()]
    return markdown_table(["model", "format", "greedy tokens equal to the first difference",
                           "llama.cpp's top-2 margin there", "differences beyond the bound"],
                          rows)


def probe_table(results: dict) -> str:
    """The machine probe before each system's offline runs (GFLOP/s, median (min-max))."""
    rows = [[model, fmt, *(_cell(by_system.get(s), 0) for s in SYSTEMS)]
            for model, formats in results.get("probe", {}).items()
            for fmt, by_system in formats.items()]
    return markdown_table(["model", "format", "probe before radixlm", "probe before llama.cpp"],
                          rows)
