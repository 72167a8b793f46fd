"""Load a hostile client puts on `radixlm serve`: an abort storm and a flood of streams.

    python benchmarks/hostile_load.py                   # both, on the tiny model
    python benchmarks/hostile_load.py --storm 2000 --disconnect 0.3 --streams 1000

1. **Abort storm**: ``--storm`` streaming requests sent at once through
   ``--concurrency`` connections; a share (``--disconnect``) of them drop the connection
   after their first chunk. Every other request must finish with all its tokens.
2. **Streams**: ``--streams`` concurrent streaming requests, one connection each, all
   open at the same time; every one must be served whole.

After each: the server is alive, idle, nothing is in flight, and every KV slot is free or
evictable (the KV invariant at idle). Prints a table with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import tempfile
import time
from pathlib import Path

import httpx

from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.tiny_model import add_model_args, resolve_model


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


async def stream_one(client: httpx.AsyncClient, body: dict, drop: bool) -> tuple[str, int]:
    """('dropped' | 'ok' | 'short' | 'error', output tokens seen)."""
    tokens = 0
    try:
        async with client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                return f"http {resp.status_code}", 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "error", tokens
                tokens = chunk["meta_info"]["completion_tokens"]
                if drop:
                    return "dropped", tokens
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}", tokens
    want = body["sampling_params"]["max_new_tokens"]
    return ("ok" if tokens == want else "short"), tokens


async def run_many(url: str, bodies: list[tuple[dict, bool]], connections: int) -> dict:
    """Send every body, at most ``connections`` at a time. The semaphore keeps requests
    out of httpx's pool queue, whose cost grows with its length (the client, not the
    server, was the bottleneck of a 2,000-request storm without it)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    gate = asyncio.Semaphore(connections)

    async def gated(client: httpx.AsyncClient, body: dict, drop: bool) -> tuple[str, int]:
        async with gate:
            return await stream_one(client, body, drop)

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        results = await asyncio.gather(*[gated(client, b, d) for b, d in bodies])
    wall = time.monotonic() - t0
    counts: dict[str, int] = {}
    for status, _ in results:
        counts[status] = counts.get(status, 0) + 1
    served = sum(n for status, n in results if status == "ok")
    return {"wall_s": wall, "counts": counts, "tokens": served}


def idle_state(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                and info["num_inflight_requests"] == 0) or time.monotonic() > deadline:
            return info


def kv_whole(info: dict) -> bool:
    return (info["protected_tokens"] == 0
            and info["free_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"])


def bodies_for(n: int, drop_share: float, out_len: int, rng: random.Random
               ) -> list[tuple[dict, bool]]:
    return [({"text": f"request {i}: " + " ".join(rng.choice("abcdefgh") for _ in range(20)),
              "stream": True,
              "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True}},
             rng.random() < drop_share) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--storm", type=int, default=2000)
    ap.add_argument("--disconnect", type=float, default=0.3)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    add_model_args(ap)
    args = ap.parse_args()
    model = resolve_model(args.model_path, args.preset)
    raise_fd_limit(4 * args.streams + 256)
    rng = random.Random(args.seed)
    log = Path(tempfile.mkdtemp()) / "server.log"
    srv = ServerProcess(["--max-total-tokens", "65536", "--max-running-requests", "256",
                         "--log-level", "warning", "--model-path", model], log)
    rows = []
    try:
        srv.wait_healthy()
        storm = asyncio.run(run_many(srv.url, bodies_for(args.storm, args.disconnect,
                                                          args.output_len, rng),
                                     args.concurrency))
        after_storm = idle_state(srv.url)
        rows.append(("abort storm", args.storm, args.concurrency, storm, after_storm))
        streams = asyncio.run(run_many(srv.url, bodies_for(args.streams, 0.0, args.output_len,
                                                            rng), args.streams))
        after_streams = idle_state(srv.url)
        rows.append(("concurrent streams", args.streams, args.streams, streams, after_streams))
        alive = httpx.get(srv.url + "/health").status_code == 200
    finally:
        code = srv.stop()
    print(f"radixlm serve (tiny model), {args.output_len} output tokens per request, "
          f"exit code after SIGTERM {code}, server healthy at the end: {alive}")
    print("| load | requests | connections | outcomes | wall (s) | output tok/s | "
          "idle KV whole | in flight after |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, conns, res, info in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(res["counts"].items()))
        print(f"| {name} | {n} | {conns} | {outcomes} | {res['wall_s']:.1f} | "
              f"{res['tokens'] / res['wall_s']:.0f} | {kv_whole(info)} | "
              f"{info['num_inflight_requests']} |")
    if "Traceback" in srv.log():
        print("the server logged a traceback:\n" + srv.log()[-2000:])


if __name__ == "__main__":
    main()
