"""A PD cluster for the server tests: a monolithic server, a prefill and a decode server,
and the built-in PD router in a thread (what ``radixlm serve-pd`` runs)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from radixlm.runtime.disaggregation.pd_router import PDRouter
from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port
from tests.runtime.disaggregation.pd_client import secret_flags


@contextlib.contextmanager
def _pd_cluster(d: Path, flags: list[str], pd: list[str],
               decode: list[str] = ()) -> Iterator[tuple]:
    """``flags`` for all three servers, ``pd`` for both PD servers (a fresh bootstrap port
    is added, and a shared secret), ``decode`` for the decode server. Yields (mono,
    prefill, decode, router url, bootstrap port)."""
    bport = free_port()
    pd = [*pd, "--disaggregation-bootstrap-port", str(bport), *secret_flags(d)]
    servers = [ServerProcess(flags, d / "mono.log"),
               ServerProcess(flags + pd + ["--disaggregation-mode", "prefill"], d / "p.log"),
               ServerProcess(flags + pd + ["--disaggregation-mode", "decode", *decode],
                             d / "d.log")]
    port = free_port()
    config = uvicorn.Config(PDRouter(servers[1].url, servers[2].url, "127.0.0.1", bport).app(),
                            host="127.0.0.1", port=port, log_level="warning")
    router = uvicorn.Server(config)
    thread = threading.Thread(target=router.run, daemon=True)
    try:
        for s in servers:
            s.wait_healthy()
        thread.start()
        while not router.started:
            time.sleep(0.05)
        yield (*servers, f"http://127.0.0.1:{port}", bport)
    finally:
        router.should_exit = True
        if thread.is_alive():  # not started when a server never became healthy
            thread.join(timeout=10)
        for s in servers:
            s.stop()


@pytest.fixture(scope="session")
def pd_cluster():
    """``_pd_cluster``, for a module's fixture to enter."""
    return _pd_cluster
