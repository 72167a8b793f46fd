"""``radixlm serve-pd``: one prefill server, one decode server and a small router, on one
machine.

The router (``pd_router.PDRouter``) does what sglang-router's PD mode does with a request.

``--router sglang`` runs sglang-router's own ``--pd-disaggregation`` instead (its Python
given by ``--sglang-router-python``).

Both servers get the same ``--disaggregation-secret-file``: the one given in the server
flags, else a fresh random key in a private (0700) temporary directory, removed at exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import uvicorn

from radixlm.runtime.disaggregation.auth import SECRET_FLAG, write_secret
from radixlm.runtime.disaggregation.pd_router import PDRouter

logger = logging.getLogger(__name__)


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
    """Start both servers (``server_flags`` go to both, with a shared secret file), wait
    for them, serve the router until SIGINT/SIGTERM, then stop everything."""
    if any(f.split("=")[0] == SECRET_FLAG for f in server_flags):
        return _run(args, server_flags)
    with tempfile.TemporaryDirectory(prefix="radixlm-pd-") as d:  # mkdtemp: mode 0700
        write_secret(os.path.join(d, "secret"))
        return _run(args, [*server_flags, SECRET_FLAG, os.path.join(d, "secret")])


def _run(args: argparse.Namespace, server_flags: list[str]) -> int:
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
