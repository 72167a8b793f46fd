"""``radixlm serve-pd``: one prefill server, one decode server and a small router, on one
machine.

The router (``pd_router.PDRouter``) does what sglang-router's PD mode does with a request.

``--router sglang`` runs sglang-router's own ``--pd-disaggregation`` instead (its Python
given by ``--sglang-router-python``).

Both servers get the same ``--disaggregation-secret-file``: the one given in the server
flags, else a fresh random key in a private (0700) temporary directory, removed at exit.

SIGTERM and SIGINT both stop it: every child gets SIGTERM (the servers drain) and it exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
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


def wait_healthy(url: str, proc: subprocess.Popen, stop: threading.Event,
                 timeout: float = 600) -> bool:
    """Wait for ``url``'s /health: True once it answers 200, False when ``stop`` is set
    first; RuntimeError if the server exits, TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(0.3)
    if stop.is_set():
        return False
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
    """SIGTERM means what SIGINT means (a supervisor sends TERM): both only set ``stop``,
    so whatever runs (the wait for the servers, the router) returns and every child is
    stopped; uvicorn handles them itself while the router serves, then raises the signal
    again into ``stop``. Left to Python's default, TERM would end this process at once
    and leave the servers running."""
    stop = threading.Event()  # set from a signal handler: never blocks, never raises
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: list[subprocess.Popen] = []
    try:
        return _serve(args, server_flags, procs, stop)
    finally:
        stop.set()
        _stop_children(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, server_flags: list[str], procs: list[subprocess.Popen],
           stop: threading.Event) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    pport, dport = args.prefill_port or args.port + 1, args.decode_port or args.port + 2
    host, bport = args.host, args.disaggregation_bootstrap_port
    procs.append(subprocess.Popen(server_cmd("prefill", host, pport, bport,
                                             server_flags + args.prefill_args.split())))
    procs.append(subprocess.Popen(server_cmd("decode", host, dport, bport,
                                             server_flags + args.decode_args.split())))
    prefill, decode = f"http://{host}:{pport}", f"http://{host}:{dport}"
    for url, proc in zip((prefill, decode), procs):
        if not wait_healthy(url, proc, stop):
            return 0
    if args.router == "sglang":
        router = subprocess.Popen([
            args.sglang_router_python, "-m", "sglang_router.launch_router",
            "--pd-disaggregation", "--host", host, "--port", str(args.port),
            "--prefill", prefill, str(bport), "--decode", decode])
        procs.append(router)
        while router.poll() is None and not stop.wait(0.5):
            pass
        return router.returncode or 0
    logger.info("serve-pd: router on http://%s:%d (prefill %s, decode %s)", host,
                args.port, prefill, decode)
    server = uvicorn.Server(uvicorn.Config(PDRouter(prefill, decode, host, bport).app(),
                                           host=host, port=args.port, log_level="warning"))

    def exit_on_stop() -> None:  # a signal before uvicorn's own handlers are in place
        stop.wait()
        server.should_exit = True

    threading.Thread(target=exit_on_stop, name="serve-pd-stop", daemon=True).start()
    server.run()
    return 0


def _stop_children(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """SIGTERM to each (they drain as on SIGINT), the router first; SIGKILL to any still
    running after ``timeout``."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
