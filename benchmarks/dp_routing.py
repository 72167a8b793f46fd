"""Data-parallel routing: ``radixlm serve --dp-size 4`` with each ``--load-balance-method``
against SGLang's router (``sglang-router``, its Rust binary) in front of four single-replica
``radixlm serve`` workers, on one multi-tenant shared-prefix workload, all in one run.

Workload: ``--tenants`` tenants, each with a system prompt of ``--prefix-tokens`` tokens
(text, so that the router's own cache-aware tree sees it), ``--requests-per-tenant``
questions of ``--suffix-tokens`` tokens each, shuffled into one random arrival order (the
same for every configuration), sent at a fixed ``--concurrency`` as streaming
``/generate`` requests; ``--output-tokens`` greedy tokens each, EOS ignored. Every
configuration starts cold: fresh servers, or (router) the workers' caches flushed.

Reported per configuration: prompt-token cache hit rate (cached / prompt tokens, from each
response's ``meta_info``), prompt tokens recomputed (prompt - cached), output tokens per
second (all outputs / wall time), TTFT p50 / p99, and how many requests each replica or
worker served.

    .venv/bin/python benchmarks/dp_routing.py
    .venv/bin/python benchmarks/dp_routing.py --tenants 16 --concurrency 8 --skip-router

The default model is the built-in tiny one: on a small shared machine (each replica gets
one CPU thread; four replicas on two cores contend) the hit rate and the prefill work
saved are the point; throughput and TTFT move with that, but also with the machine's
other load. The router runs in a virtual environment under ~/.cache/radixlm, built once
by ``tests/compat/test_sglang_router.py``'s ``router_python`` (pip install sglang-router).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port
from radixlm.runtime.managers.data_parallel.load_balancer import common_prefix_len
from radixlm.runtime.tokenizer import load_tokenizer
from radixlm.tiny_model import add_model_args, resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.compat.test_sglang_router import router_python  # noqa: E402

INTERNAL = ("round_robin", "shortest_queue", "cache_aware")
ROUTER = ("round_robin", "cache_aware")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu river mountain cloud stone garden window paper silver orange planet").split()


@dataclass
class Result:
    name: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    wall_s: float
    ttfts: list[float]
    per_replica: list[int]
    decisions: dict[str, int] | None = None  # radixlm cache_aware: cache / balance / miss

    def row(self) -> str:
        hit = self.cached_tokens / max(self.prompt_tokens, 1)
        ttft = sorted(self.ttfts)
        p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
        return (f"| {self.name} | {100 * hit:.1f}% | {self.prompt_tokens - self.cached_tokens} "
                f"| {self.output_tokens / self.wall_s:.1f} | {1000 * statistics.median(ttft):.0f} "
                f"| {1000 * p99:.0f} | {'/'.join(map(str, self.per_replica))} |")


def text_of(tokenizer: object, rng: random.Random, n_tokens: int) -> str:
    """Random words, cut at the first word that reaches ``n_tokens`` tokens."""
    words: list[str] = []
    while (have := len(tokenizer.encode(" ".join(words), add_special_tokens=False))) < n_tokens:
        words += [rng.choice(WORDS) for _ in range((n_tokens - have) // 4 + 1)]
    return " ".join(words)


def workload(args: argparse.Namespace, tokenizer: object) -> list[str]:
    rng = random.Random(args.seed)
    prefixes = [f"Tenant {t} system prompt: " + text_of(tokenizer, rng, args.prefix_tokens)
                for t in range(args.tenants)]
    prompts = [f"{p}\nQuestion {q}: " + text_of(tokenizer, rng, args.suffix_tokens)
               for p in prefixes for q in range(args.requests_per_tenant)]
    rng.shuffle(prompts)
    return prompts


def hit_rate_bound(tokenizer: object, prompts: list[str]) -> float:
    """The best hit rate any dispatcher can reach: each prompt's longest prefix shared with
    an earlier one (in arrival order), as if one unbounded cache served them all."""
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    cached = 0
    for i, x in enumerate(ids):
        cached += max((min(common_prefix_len(x, y), len(x) - 1) for y in ids[:i]), default=0)
    return cached / sum(map(len, ids))


async def one_request(client: httpx.AsyncClient, url: str, text: str, out_tokens: int
                      ) -> tuple[float, dict]:
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0,
                                "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, meta = None, {}
    async with client.stream("POST", url + "/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk["meta_info"]["completion_tokens"] > 0:
                ttft = time.perf_counter() - t0
            meta = chunk["meta_info"]
    assert ttft is not None, meta
    return ttft, meta


async def drive(url: str, prompts: list[str], concurrency: int, out_tokens: int
                ) -> tuple[float, list[tuple[float, dict]]]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def bounded(text: str) -> tuple[float, dict]:
            async with sem:
                return await one_request(client, url, text, out_tokens)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*[bounded(p) for p in prompts])
        return time.perf_counter() - t0, outs


def measure(name: str, url: str, prompts: list[str], args: argparse.Namespace,
            served: Callable[[], list[int]]) -> Result:
    before = served()
    wall, outs = asyncio.run(drive(url, prompts, args.concurrency, args.output_tokens))
    after = served()
    return Result(name, sum(m["prompt_tokens"] for _, m in outs),
                  sum(m["cached_tokens"] for _, m in outs),
                  sum(m["completion_tokens"] for _, m in outs), wall, [t for t, _ in outs],
                  [(a - b) // args.output_tokens for a, b in zip(after, before)])


def warm_up(url: str, n: int) -> None:
    """A few unrelated requests (first-step costs), then an empty cache."""
    asyncio.run(drive(url, [f"warm up {i} " + "word " * 40 for i in range(n)], n, 4))
    httpx.post(url + "/flush_cache", params={"timeout": 30}, timeout=60).raise_for_status()


def generated(url: str) -> list[int]:
    """Tokens each replica has generated so far; every request of the workload generates
    ``--output-tokens`` (EOS ignored), so a difference over a run / that is its requests."""
    info = httpx.get(url + "/get_server_info", timeout=60).json()
    return [s["generation_tokens"] for s in info.get("internal_states") or [info]]


def decisions(url: str) -> Counter:
    """cache_aware's choices so far (by cache, balancing the load, no cached prefix)."""
    info = httpx.get(url + "/get_server_info", timeout=60).json()
    return Counter(info.get("dp_decisions") or {})


def server_flags(args: argparse.Namespace, model: str) -> list[str]:
    return ["--model-path", model, "--max-total-tokens", str(args.pool),
            "--log-level", "warning"]


def run_internal(args: argparse.Namespace, model: str, prompts: list[str], logs: Path
                 ) -> list[Result]:
    results = []
    for method in args.methods:
        srv = ServerProcess([*server_flags(args, model), "--dp-size", str(args.replicas),
                             "--cpu-threads", str(args.replicas),
                             "--load-balance-method", method], logs / f"dp-{method}.log")
        try:
            srv.wait_healthy(args.start_timeout)
            warm_up(srv.url, 2 * args.replicas)
            before = decisions(srv.url)
            results.append(measure(f"radixlm --dp-size {args.replicas} {method}", srv.url,
                                   prompts, args, lambda s=srv: generated(s.url)))
            results[-1].decisions = dict(decisions(srv.url) - before)
        finally:
            srv.stop()
        print(results[-1].row(), flush=True)
    return results


def start_router(python: Path, policy: str, workers: list[ServerProcess], log: Path
                 ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", policy, "--worker-urls", *[w.url for w in workers],
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited: {log.read_text()}")
        try:
            if len(httpx.get(url + "/get_loads", timeout=5).json().get("workers", [])) == len(
                    workers):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the router did not register the workers")


def run_router(args: argparse.Namespace, model: str, prompts: list[str], logs: Path
               ) -> list[Result]:
    python = router_python()
    workers = [ServerProcess([*server_flags(args, model), "--cpu-threads", "1"],
                             logs / f"worker{i}.log") for i in range(args.replicas)]
    results = []
    try:
        for w in workers:
            w.wait_healthy(args.start_timeout)
        for w in workers:
            warm_up(w.url, 2)

        def served() -> list[int]:
            return [generated(w.url)[0] for w in workers]

        for policy in args.router_policies:
            for w in workers:
                httpx.post(w.url + "/flush_cache", params={"timeout": 30},
                           timeout=60).raise_for_status()
            proc, url = start_router(python, policy, workers, logs / f"router-{policy}.log")
            try:
                results.append(measure(f"sglang-router {policy} + {args.replicas} workers", url,
                                       prompts, args, served))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            print(results[-1].row(), flush=True)
    finally:
        for w in workers:
            w.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--requests-per-tenant", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=300)
    p.add_argument("--suffix-tokens", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pool", type=int, default=16384, help="KV tokens per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to start (a loaded machine is slow)")
    p.add_argument("--methods", nargs="*", default=list(INTERNAL), choices=INTERNAL,
                   help="radixlm's --load-balance-method values to run")
    p.add_argument("--router-policies", nargs="*", default=list(ROUTER), choices=ROUTER,
                   help="sglang-router --policy values to run")
    p.add_argument("--skip-router", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    model = resolve_model(args.model_path, args.preset)
    tokenizer = load_tokenizer(model)
    prompts = workload(args, tokenizer)
    logs = Path(tempfile.mkdtemp(prefix="dp-routing-"))
    print(f"{len(prompts)} requests ({args.tenants} tenants x {args.requests_per_tenant}), "
          f"concurrency {args.concurrency}, {args.replicas} replicas; best possible hit rate "
          f"{100 * hit_rate_bound(tokenizer, prompts):.1f}%; logs in {logs}\n")
    print("| configuration | hit rate | prompt tokens recomputed | output tok/s | TTFT p50 ms "
          "| TTFT p99 ms | requests per replica |")
    print("|---|---|---|---|---|---|---|", flush=True)
    results = run_internal(args, model, prompts, logs)
    if not args.skip_router:
        results += run_router(args, model, prompts, logs)
    if args.json is not None:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))
    for r in results:
        if r.decisions:
            print(f"{r.name}: dispatcher decisions {r.decisions}")
    counts = Counter(r.name.split()[0] for r in results)
    print(f"\n{sum(counts.values())} configurations")


if __name__ == "__main__":
    main()
