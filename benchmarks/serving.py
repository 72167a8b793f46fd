"""Online serving benchmark: ``radixlm bench serve`` against ``radixlm serve`` (launched
here, or any server with ``--url``), and the offline Engine on the same prompts.

    python benchmarks/serving.py                       # launch radixlm serve, then Engine
    python benchmarks/serving.py --url http://host:port --no-engine   # any such server
    python benchmarks/serving.py --request-rate 8      # Poisson arrivals instead
    python benchmarks/serving.py --backend openai --slo ttft=300,tpot=20 --plot plots/

Every flag this script does not define is ``radixlm bench serve``'s (see its --help); the
defaults here are the generated shared-prefix workload of the other benchmarks: 4 groups x
8 prompts, a 512-token system prompt per group and a 32-token question, 32 output tokens
(ignore_eos, greedy), at most 32 requests in flight. Prints the client's report (request
and token throughput, TTFT / TPOT / ITL / E2E at mean, p50, p90, p99, cache hit rate), and
the server's output throughput as a share of the Engine's (the Engine gets the whole
workload as one batch).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from radixlm import Engine
from radixlm.bench.datasets import Conversation, sample_conversations
from radixlm.bench.serve import bench_tokenizer, build_parser, run_benchmark
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.tiny_model import add_model_args, resolve_model

BENCH_DEFAULTS = [
    "--backend", "radixlm", "--dataset-name", "generated-shared-prefix",
    "--gsp-num-groups", "4", "--gsp-prompts-per-group", "8", "--gsp-system-prompt-len", "512",
    "--gsp-question-len", "32", "--gsp-output-len", "32", "--max-concurrency", "32",
]


def run_engine(convs: list[Conversation], flags: dict) -> float:
    """The offline Engine on the same prompts, all in one batch: output tok/s."""
    prompts = [c.turns[0].text for c in convs]
    sps = [{"max_new_tokens": c.turns[0].output_len, "ignore_eos": True, "temperature": 0}
           for c in convs]
    with Engine(**flags) as eng:
        eng.generate(["Hello"], {"max_new_tokens": 2})
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sps)
        wall = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    print(
        f"== offline Engine (one batch of {len(prompts)}, "
        f"{torch.get_num_threads()} torch threads) ==\n"
        f"duration {wall:.2f} s  output {tokens / wall:.1f} tok/s  "
        f"total {(tokens + prompt_tokens) / wall:.1f} tok/s\n"
    )
    return tokens / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--url", help="a running server (default: launch radixlm serve)")
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--server-env", nargs="*", default=[], help="KEY=VALUE for the server")
    p.add_argument("--engine-threads", type=int, default=None,
                   help="torch threads of the Engine run (default: the server's default)")
    p.add_argument("--no-engine", action="store_true", help="skip the offline Engine run")
    add_model_args(p)
    own, rest = p.parse_known_args()
    args = build_parser().parse_args(BENCH_DEFAULTS + rest)
    model = resolve_model(own.model_path, own.preset)
    args.tokenizer = args.tokenizer or model
    convs = sample_conversations(args, bench_tokenizer(args))
    single_turn = all(len(c.turns) == 1 and not c.chat for c in convs)
    flags = {"max_total_tokens": own.max_total_tokens, "random_seed": 0, "model_path": model}
    # the same torch thread count as the server's scheduler process, for a fair comparison
    torch.set_num_threads(ServerArgs(cpu_threads=own.engine_threads).resolve_cpu_threads())
    engine_tps = None if own.no_engine or not single_turn else run_engine(convs, flags)
    server = None
    if own.url is None:
        log = Path(tempfile.mkdtemp()) / "server.log"
        server = ServerProcess(
            ["--max-total-tokens", str(own.max_total_tokens), "--log-level", "warning",
             "--model-path", model],
            log,
            env=dict(e.split("=", 1) for e in own.server_env),
        )
        server.wait_healthy()
    try:
        args.base_url = own.url or server.url
        results = run_benchmark(args)
    finally:
        if server is not None:
            server.stop()
    if engine_tps:
        share = results[-1].metrics.output_throughput / engine_tps
        print(f"\nserver / Engine output throughput: {100 * share:.1f}% (target >= 85%)")


if __name__ == "__main__":
    main()
