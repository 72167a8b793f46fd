"""``radixlm serve-pd``: one prefill server, one decode server and a small router, on one
machine.

The router does what sglang-router's PD mode does with a request (and nothing more: one
prefill and one decode worker, no load balancing): it adds ``bootstrap_host``,
``bootstrap_port`` and a random ``bootstrap_room`` (lists of them for a batch or ``n > 1``,
as sglang-router), posts the same body to both servers at once, and answers with the
decode server's response (streamed when the request streams). A prefill error answers the
request at once and drops the decode request (its server then aborts the room). Other
routes go to the decode server; ``/health`` is 200 only when both are healthy.

``--router sglang`` runs sglang-router's own ``--pd-disaggregation`` instead (its Python
given by ``--sglang-router-python``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

logger = logging.getLogger(__name__)

DUAL_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def batch_size(body: dict[str, Any]) -> int | None:
    """sglang-router's rule: ``n`` > 1, or a list prompt / text / batch of input_ids."""
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return n
    for key in ("prompt", "text"):
        if isinstance(body.get(key), list) and body[key] and (
                key == "text" or not isinstance(body[key][0], int)):
            return len(body[key])
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def inject_bootstrap(body: dict[str, Any], host: str, port: int) -> dict[str, Any]:
    size = batch_size(body)
    if size is None:
        return {**body, "bootstrap_host": host, "bootstrap_port": port,
                "bootstrap_room": secrets.randbits(63)}
    return {**body, "bootstrap_host": [host] * size, "bootstrap_port": [port] * size,
            "bootstrap_room": [secrets.randbits(63) for _ in range(size)]}


class PDRouter:
    def __init__(self, prefill_url: str, decode_url: str, bootstrap_host: str,
                 bootstrap_port: int) -> None:
        self.prefill, self.decode = prefill_url, decode_url
        self.host, self.port = bootstrap_host, bootstrap_port
        self.client = httpx.AsyncClient(timeout=None)

    def app(self) -> Starlette:
        routes = [Route(p, self.dual, methods=["POST"]) for p in DUAL_ROUTES]
        routes += [Route("/health", self.health, methods=["GET"]),
                   Route("/{path:path}", self.forward, methods=["GET", "POST"])]
        return Starlette(routes=routes)

    async def dual(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return Response('{"error": {"message": "the body is not JSON"}}', 400,
                            media_type="application/json")
        if not isinstance(body, dict):
            return await self.forward(request)
        body = inject_bootstrap(body, self.host, self.port)
        path = request.url.path
        pre = asyncio.create_task(self.client.post(self.prefill + path, json=body))
        if body.get("stream"):
            return StreamingResponse(self._stream(path, body, pre),
                                     media_type="text/event-stream")
        dec = asyncio.create_task(self.client.post(self.decode + path, json=body))
        await asyncio.wait({pre, dec}, return_when=asyncio.FIRST_COMPLETED)
        if pre.done() and (pre.exception() is not None or pre.result().status_code != 200):
            dec.cancel()  # the decode server sees the client leave and aborts the room
            return _error_response(pre, "prefill")
        resp = await dec
        await asyncio.gather(pre, return_exceptions=True)
        content = resp.content
        if body.get("return_logprob") and path == "/generate" and resp.status_code == 200:
            content = merge_prompt_logprobs(pre, content)
        return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))

    async def _stream(self, path: str, body: dict[str, Any], pre: asyncio.Task) -> Any:
        try:
            async with self.client.stream("POST", self.decode + path, json=body) as resp:
                async for chunk in resp.aiter_raw():
                    yield chunk
        finally:
            await asyncio.gather(pre, return_exceptions=True)

    async def health(self, request: Request) -> Response:
        for url in (self.prefill, self.decode):
            try:
                if (await self.client.get(url + "/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    async def forward(self, request: Request) -> Response:
        url = self.decode + request.url.path
        resp = await self.client.request(request.method, url, params=request.query_params,
                                         content=await request.body(),
                                         headers={"content-type": request.headers.get(
                                             "content-type", "application/json")})
        return Response(resp.content, resp.status_code,
                        media_type=resp.headers.get("content-type"))


# the prompt's logprobs are computed on the prefill server only
PROMPT_LOGPROB_FIELDS = ("input_token_logprobs", "input_top_logprobs",
                         "input_token_ids_logprobs")


def merge_prompt_logprobs(pre: asyncio.Task, decode_body: bytes) -> bytes:
    """A /generate answer with return_logprob: the decode server's, with the prefill
    server's prompt logprobs put in front of its own (sglang-router merges
    ``input_token_logprobs`` the same way), per result of a batch."""
    if pre.exception() is not None or pre.result().status_code != 200:
        return decode_body
    try:
        prefill, decode = json.loads(pre.result().content), json.loads(decode_body)
    except ValueError:
        return decode_body
    pairs = zip(prefill, decode) if isinstance(decode, list) and isinstance(prefill, list) \
        else [(prefill, decode)]
    for p, d in pairs:
        pm, dm = p.get("meta_info", {}), d.get("meta_info", {})
        for key in PROMPT_LOGPROB_FIELDS:
            if isinstance(pm.get(key), list) and isinstance(dm.get(key), list):
                dm[key] = pm[key] + dm[key]
    return json.dumps(decode).encode()


def _error_response(task: asyncio.Task, who: str) -> Response:
    err = task.exception()
    if err is not None:
        return Response(f'{{"error": {{"message": "{who} server unreachable"}}}}', 502,
                        media_type="application/json")
    resp = task.result()
    return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))


# --- the launcher -------------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="where all three listen")
    parser.add_argument("--port", type=int, default=30000, help="the router's port")
    parser.add_argument("--prefill-port", type=int, default=None, help="default: port + 1")
    parser.add_argument("--decode-port", type=int, default=None, help="default: port + 2")
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    parser.add_argument("--router", choices=["builtin", "sglang"], default="builtin")
    parser.add_argument("--sglang-router-python", default=sys.executable,
                        help="a Python with sglang-router installed (--router sglang)")
    parser.add_argument("--prefill-args", default="", help="extra flags, prefill server only")
    parser.add_argument("--decode-args", default="", help="extra flags, decode server only")


def server_cmd(mode: str, host: str, port: int, bootstrap_port: int,
               flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "radixlm.launch_server", "--host", host, "--port", str(port),
            "--disaggregation-mode", mode, "--disaggregation-bootstrap-port",
            str(bootstrap_port), *flags]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def run(args: argparse.Namespace, server_flags: list[str]) -> int:
    """Start both servers (``server_flags`` go to both), wait for them, serve the router
    until SIGINT/SIGTERM, then stop everything."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    pport, dport = args.prefill_port or args.port + 1, args.decode_port or args.port + 2
    host, bport = args.host, args.disaggregation_bootstrap_port
    procs = [subprocess.Popen(server_cmd("prefill", host, pport, bport,
                                         server_flags + args.prefill_args.split())),
             subprocess.Popen(server_cmd("decode", host, dport, bport,
                                         server_flags + args.decode_args.split()))]
    prefill, decode = f"http://{host}:{pport}", f"http://{host}:{dport}"
    try:
        for url, proc in zip((prefill, decode), procs):
            wait_healthy(url, proc)
        if args.router == "sglang":
            router = subprocess.Popen([
                args.sglang_router_python, "-m", "sglang_router.launch_router",
                "--pd-disaggregation", "--host", host, "--port", str(args.port),
                "--prefill", prefill, str(bport), "--decode", decode])
            procs.append(router)
            return router.wait()
        logger.info("serve-pd: router on http://%s:%d (prefill %s, decode %s)", host,
                    args.port, prefill, decode)
        uvicorn.run(PDRouter(prefill, decode, host, bport).app(), host=host, port=args.port,
                    log_level="warning")
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
