"""What large stored responses cost `radixlm serve` (issue 55's Responses findings).

    python benchmarks/responses_store_load.py              # both, on the tiny model
    python benchmarks/responses_store_load.py --readers 16 --item-mb 7

1. **Memory**: six ~6.9 MB ``/v1/responses`` requests whose input items carry a field the
   server ignores (860k small objects): the HTTP process's RSS before, after, and 5 s
   later. The store should hold what it counts, not the parsed objects.
2. **Loop**: ``--readers`` clients each store a response whose input items list is about
   ``--item-mb`` MB, then read it back in a loop (from another process) while ``/health``
   is timed; the p50 and p99 of ``/health`` against the same server idle. ``--payload``:
   see ``item_request``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from multiprocessing import Process, Queue
from pathlib import Path

import httpx

from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.tiny_model import add_model_args, resolve_model


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def junk_request(objects: int) -> dict:
    return {"input": [{"role": "user", "content": "Say hi",
                       "junk": [{"k": i % 10} for i in range(objects)]}],
            "max_output_tokens": 1, "temperature": 0}


def memory(srv: ServerProcess, requests: int, objects: int) -> None:
    """RSS after ``requests`` requests, 5 s later, and after as many again (a store that
    keeps what it parsed grows again; a high-water mark of parsing does not)."""
    pid = srv.proc.pid
    seen = [rss_mb(pid)]
    with httpx.Client(timeout=300) as client:
        for _ in range(2):
            for _ in range(requests):
                resp = client.post(srv.url + "/v1/responses", json=junk_request(objects))
                assert resp.status_code == 200, resp.text[:300]
            seen.append(rss_mb(pid))
            time.sleep(5)
            seen.append(rss_mb(pid))
    body_mb = len(httpx.Request("POST", "/", json=junk_request(objects)).content) / 1e6
    print(f"memory: requests of {body_mb:.1f} MB: HTTP process RSS {seen[0]:.0f} MB; after "
          f"{requests}: {seen[1]:.0f} MB ({seen[2]:.0f} MB 5 s later); after {2 * requests}: "
          f"{seen[3]:.0f} MB ({seen[4]:.0f} MB)")


def item_request(mb: float, payload: str) -> dict:
    """A request whose input items are about ``mb`` MB of JSON: ``parts``, a reasoning item
    of ~20-byte text parts (kept and listed; the tiny model's template renders no
    reasoning); ``junk``, an ignored field of as many small objects (kept and listed before
    the store kept only validated items; such servers refuse reasoning items)."""
    n = int(mb * 1e6 / 40)
    if payload == "junk":
        items = [{"role": "user", "content": "Say hi",
                  "junk": [{"type": "reasoning_text", "text": f"t{i}"} for i in range(n)]}]
    else:
        items = [{"type": "reasoning", "summary": [],
                  "content": [{"type": "reasoning_text", "text": f"t{i}"} for i in range(n)]},
                 {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hi"}]
    return {"input": items, "max_output_tokens": 1, "temperature": 0}


async def health_times(client: httpx.AsyncClient, url: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        resp = await client.get(url + "/health")
        times.append((time.perf_counter() - t0) * 1e3)
        assert resp.status_code == 200
        await asyncio.sleep(0.02)
    return times


async def _read_until(url: str, ids: list[str], seconds: float) -> int:
    """Each id's input items read in a loop by its own client for ``seconds``; the reads."""
    limits = httpx.Limits(max_connections=len(ids) + 1)
    deadline = time.monotonic() + seconds
    reads = 0
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def reader(rid: str) -> None:
            nonlocal reads
            while time.monotonic() < deadline:
                resp = await client.get(f"{url}/v1/responses/{rid}/input_items")
                assert resp.status_code == 200
                reads += 1

        await asyncio.gather(*[reader(rid) for rid in ids])
    return reads


def _readers(url: str, ids: list[str], seconds: float, out: Queue) -> None:
    out.put(asyncio.run(_read_until(url, ids, seconds)))


def loop_load(srv: ServerProcess, readers: int, mb: float, payload: str) -> None:
    """The readers in another process (their client's own loop must not delay ours)."""
    with httpx.Client(timeout=300) as client:
        ids = []
        for _ in range(readers):
            resp = client.post(srv.url + "/v1/responses", json=item_request(mb, payload))
            assert resp.status_code == 200, resp.text[:300]
            ids.append(resp.json()["id"])
        size = len(client.get(f"{srv.url}/v1/responses/{ids[0]}/input_items").content)
    idle = asyncio.run(_health(srv.url, 100))
    out: Queue = Queue()
    proc = Process(target=_readers, args=(srv.url, ids, 8.0, out))
    proc.start()
    time.sleep(2)
    busy = asyncio.run(_health(srv.url, 100))
    reads = out.get()
    proc.join()

    def p(xs: list[float], q: int) -> float:
        return statistics.quantiles(xs, n=100)[q - 1]

    print(f"loop: {readers} readers of {size / 1e6:.1f} MB input_items ({reads} reads in 8 s): "
          f"/health p50 {p(idle, 50):.1f} ms idle -> {p(busy, 50):.1f} ms, "
          f"p99 {p(idle, 99):.1f} -> {p(busy, 99):.1f} ms")


async def _health(url: str, n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await health_times(client, url, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--objects", type=int, default=860_000)
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--item-mb", type=float, default=7.0)
    parser.add_argument("--payload", choices=("parts", "junk"), default="parts")
    parser.add_argument("--only", choices=("memory", "loop"), default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model(args.model_path, args.preset)
        srv = ServerProcess(["--model-path", model, "--log-level", "warning",
                             "--max-total-tokens", "4096"], Path(tmp) / "server.log")
        try:
            srv.wait_healthy()
            if args.only != "loop":
                memory(srv, args.requests, args.objects)
            if args.only != "memory":
                loop_load(srv, args.readers, args.item_mb, args.payload)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
