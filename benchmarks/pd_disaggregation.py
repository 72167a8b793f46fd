"""Prefill/decode disaggregation on one machine: does it pay here?

Workload: ``--chats`` short chats decode without pause (each a stream of
``--chat-tokens`` tokens, restarted when it ends) while ``--docs`` documents of
``--doc-tokens`` tokens arrive every ``--doc-interval`` seconds (each wants
``--doc-new-tokens`` tokens). Measured: inter-token latency p50/p99 of the chats, TTFT of
the documents, and, for PD, the KV transfer cost (bytes and milliseconds per 1k tokens,
from the prefill server's ``kv_transfer_*`` counters).

    monolithic: one server, chunked prefill, --cpu-threads T
    PD:         a prefill server and a decode server with T/2 threads each, the built-in
                PD router in front (what ``radixlm serve-pd`` runs)

    python benchmarks/pd_disaggregation.py --threads 2 --docs 4

Timed numbers go to docs/benchmarks.md, never into tests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from radixlm.runtime.disaggregation.pd_router import PDRouter
from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


async def chat_loop(client: httpx.AsyncClient, url: str, args, stop: asyncio.Event,
                    itls: list[float], seed: int) -> None:
    n = 0
    while not stop.is_set():
        body = {"text": f"chat {seed} turn {n}: tell me something", "stream": True,
                "sampling_params": {"max_new_tokens": args.chat_tokens, "ignore_eos": True,
                                    "temperature": 0}}
        last = None
        async with client.stream("POST", url + "/generate", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None:
                    itls.append(now - last)
                last = now
        n += 1


async def doc(client: httpx.AsyncClient, url: str, args, i: int, ttfts: list[float]) -> None:
    ids = [(i * 7919 + k * 31) % 1900 + 3 for k in range(args.doc_tokens)]  # distinct docs
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": args.doc_new_tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"document {i}: {resp.status_code} {await resp.aread()!r}")
        first = True
        async for line in resp.aiter_lines():
            if first and line.startswith("data:"):
                ttfts.append(time.perf_counter() - t0)
                first = False


async def workload(url: str, args) -> dict[str, float]:
    itls: list[float] = []
    ttfts: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=None) as client:
        chats = [asyncio.create_task(chat_loop(client, url, args, stop, itls, s))
                 for s in range(args.chats)]
        await asyncio.sleep(args.doc_interval)  # chats reach their steady state first
        docs = []
        for i in range(args.docs):
            docs.append(asyncio.create_task(doc(client, url, args, i, ttfts)))
            await asyncio.sleep(args.doc_interval)
        await asyncio.gather(*docs)
        stop.set()
        await asyncio.gather(*chats)
    return {"itl_p50_ms": 1e3 * pct(itls, 0.5), "itl_p99_ms": 1e3 * pct(itls, 0.99),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_max_s": max(ttfts)}


def run_mono(args, tmp: Path, threads: int) -> dict[str, float]:
    srv = ServerProcess(args.flags + ["--cpu-threads", str(threads)], tmp / "mono.log")
    try:
        srv.wait_healthy()
        return asyncio.run(workload(srv.url, args))
    finally:
        srv.stop()


def run_pd(args, tmp: Path) -> dict[str, float]:
    bport = free_port()
    half = str(max(args.threads // 2, 1))
    pd = ["--cpu-threads", half, "--disaggregation-bootstrap-port", str(bport),
          "--disaggregation-mode"]
    prefill = ServerProcess(args.flags + pd + ["prefill"], tmp / "prefill.log")
    dec = ServerProcess(args.flags + pd + ["decode"], tmp / "decode.log")
    port = free_port()
    router = uvicorn.Server(uvicorn.Config(PDRouter(prefill.url, dec.url, "127.0.0.1",
                                                    bport).app(),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=router.run, daemon=True)
    try:
        prefill.wait_healthy()
        dec.wait_healthy()
        thread.start()
        while not router.started:
            time.sleep(0.05)
        out = asyncio.run(workload(f"http://127.0.0.1:{port}", args))
        info = httpx.get(prefill.url + "/server_info").json()
        tokens = max(info["kv_transfer_sent_tokens"], 1)
        out["transfer_MB_per_1k_tokens"] = info["kv_transfer_bytes_per_token"] * 1000 / 1e6
        out["transfer_ms_per_1k_tokens"] = 1e3 * info["kv_transfer_seconds"] * 1000 / tokens
        return out
    finally:
        router.should_exit = True
        thread.join(timeout=10)
        prefill.stop()
        dec.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="total torch threads")
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-tokens", type=int, default=64)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--doc-new-tokens", type=int, default=8)
    p.add_argument("--doc-interval", type=float, default=2.0)
    p.add_argument("--model-path", default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    args = p.parse_args()
    args.flags = ["--max-total-tokens", "16384", "--log-level", "warning",
                  "--chunked-prefill-size", str(args.chunked_prefill_size)]
    if args.model_path:
        args.flags += ["--model-path", args.model_path]
    with tempfile.TemporaryDirectory() as d:
        # also one thread: on a loaded machine, fewer threads than busy cores can win
        rows = {f"monolithic, {t} thread(s)": run_mono(args, Path(d), t)
                for t in sorted({args.threads, 1}, reverse=True)}
        rows[f"PD, {max(args.threads // 2, 1)} thread(s) each"] = run_pd(args, Path(d))
    keys = sorted({k for r in rows.values() for k in r})
    print("| setup | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[k]:.3g}" if k in r else "-" for k in keys)
              + " |")


if __name__ == "__main__":
    main()
