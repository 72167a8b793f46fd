"""Online serving benchmark: the generated shared-prefix workload against a server that
speaks SGLang's native /generate API, and the offline Engine on the same workload.

    python benchmarks/serving.py                       # launch radixlm serve, then Engine
    python benchmarks/serving.py --url http://host:port --no-engine   # any such server
    python benchmarks/serving.py --request-rate 8      # Poisson arrivals instead

Workload: ``--num-groups`` groups x ``--prompts-per-group`` prompts; each group shares a
``--system-prompt-len``-token system prompt, each prompt adds a ``--question-len``-token
question; ``--output-len`` tokens out, ignore_eos. Prompts are random token ids (sent as
input_ids) so the lengths are exact. Prints request and token throughput and TTFT, TPOT,
ITL and end-to-end latency at p50/p90/p99, and the server's output throughput as a share
of the Engine's (the Engine gets the whole workload as one batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from radixlm import Engine
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_model import add_model_args, resolve_model


@dataclass
class ReqResult:
    prompt_len: int
    ttft: float = 0.0
    e2e: float = 0.0
    output_len: int = 0
    itls: list[float] = field(default_factory=list)
    ok: bool = False


def make_workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prompts = []
    for _ in range(args.num_groups):
        system = tokens(args.system_prompt_len)
        prompts += [system + tokens(args.question_len) for _ in range(args.prompts_per_group)]
    rng.shuffle(prompts)
    return prompts


async def one_request(client: httpx.AsyncClient, ids: list[int], out_len: int) -> ReqResult:
    res = ReqResult(len(ids))
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0},
    }
    t0 = last = time.perf_counter()
    async with client.stream("POST", "/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            n = json.loads(line[6:])["meta_info"]["completion_tokens"]
            if res.output_len == 0 and n:
                res.ttft = now - t0
            elif n > res.output_len:
                res.itls += [(now - last) / (n - res.output_len)] * (n - res.output_len)
            last, res.output_len = now, n
    res.e2e, res.ok = time.perf_counter() - t0, True
    return res


async def run_client(
    url: str, prompts: list[list[int]], args: argparse.Namespace, concurrency: int | None
) -> tuple[list[ReqResult], float]:
    sem = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def limited(ids: list[int]) -> ReqResult:
            async with sem:
                return await one_request(client, ids, args.output_len)

        await one_request(client, [11, 12, 13], 2)  # warm up the connection and the model
        t0 = time.perf_counter()
        tasks = []
        for ids in prompts:
            tasks.append(asyncio.create_task(limited(ids)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(int(round(p / 100 * (len(s) - 1))), len(s) - 1)] * 1000


def report(name: str, results: list[ReqResult], wall: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    row = {
        "requests": len(done),
        "duration_s": wall,
        "req_per_s": len(done) / wall,
        "output_tok_per_s": out_tokens / wall,
        "total_tok_per_s": (in_tokens + out_tokens) / wall,
    }
    print(f"\n== {name} ==")
    print(
        f"requests {len(done)}/{len(results)}  duration {wall:.2f} s  "
        f"{row['req_per_s']:.2f} req/s  output {row['output_tok_per_s']:.1f} tok/s  "
        f"total {row['total_tok_per_s']:.1f} tok/s"
    )
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, vals in (
        ("TTFT", [r.ttft for r in done]),
        ("TPOT", tpots),
        ("ITL", [x for r in done for x in r.itls]),
        ("E2E", [r.e2e for r in done]),
    ):
        mean = statistics.fmean(vals) * 1000 if vals else float("nan")
        print(
            f"{label:<12}{mean:>10.1f}{_pct(vals, 50):>10.1f}{_pct(vals, 90):>10.1f}"
            f"{_pct(vals, 99):>10.1f}"
        )
    return row


def run_engine(prompts: list[list[int]], args: argparse.Namespace, flags: dict) -> float:
    """The offline Engine on the same workload, all prompts in one batch: output tok/s."""
    with Engine(**flags) as eng:
        eng.generate(input_ids=[[11, 12, 13]], sampling_params={"max_new_tokens": 2})
        sp = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(
        f"\n== offline Engine (one batch of {len(prompts)}, "
        f"{torch.get_num_threads()} torch threads) ==\n"
        f"duration {wall:.2f} s  output {tokens / wall:.1f} tok/s  "
        f"total {(tokens + sum(map(len, prompts))) / wall:.1f} tok/s"
    )
    return tokens / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: launch radixlm serve)")
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="range of random token ids (default: the model's vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-env", nargs="*", default=[], help="KEY=VALUE for the server")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="torch threads of the Engine run (default: the server's default)",
    )
    p.add_argument("--no-engine", action="store_true", help="skip the offline Engine run")
    add_model_args(p)
    args = p.parse_args()
    model = resolve_model(args.model_path, args.preset)
    vocab = args.vocab_size or ModelConfig.from_hf(model).vocab_size
    prompts = make_workload(args, vocab)
    flags = {"max_total_tokens": args.max_total_tokens, "random_seed": 0, "model_path": model}
    # the same torch thread count as the server's scheduler process, for a fair comparison
    torch.set_num_threads(ServerArgs(cpu_threads=args.engine_threads).resolve_cpu_threads())
    engine_tps = None if args.no_engine else run_engine(prompts, args, flags)
    server = None
    if args.url is None:
        log = Path(tempfile.mkdtemp()) / "server.log"
        server = ServerProcess(
            ["--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning",
             "--model-path", model],
            log,
            env=dict(e.split("=", 1) for e in args.server_env),
        )
        server.wait_healthy()
    try:
        url = args.url or server.url
        results, wall = asyncio.run(run_client(url, prompts, args, args.max_concurrency))
        row = report(
            f"server, concurrency {args.max_concurrency}, rate {args.request_rate}", results, wall
        )
    finally:
        if server is not None:
            server.stop()
    if engine_tps:
        share = row["output_tok_per_s"] / engine_tps
        print(f"\nserver / Engine output throughput: {100 * share:.1f}% (target >= 85%)")


if __name__ == "__main__":
    main()
