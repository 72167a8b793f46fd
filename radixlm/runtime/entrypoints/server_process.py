"""Run ``radixlm serve`` as a subprocess on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx

# Ports the kernel hands out by itself (bind to port 0, a connect's local port): a port
# taken from this range and released is the next such socket's as likely as any other.
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # below this, registered services' ports are common


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default
    return low, high


def free_port() -> int:
    """A loopback TCP port free now, outside the kernel's ephemeral range where it can:
    between this call and the caller's bind (a server's import and model load, seconds),
    a zmq socket bound to a random port or an outgoing connection takes its port from
    that range, and could otherwise take this one (a CI run failed on exactly that).
    Another caller of this function picking the same port in the gap is a 1 in
    thousands chance per overlapping pair, not a steady one."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(LOWEST, 65_536) if not low <= p <= high]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything outside the range taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; Linux)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class ServerProcess:
    """``radixlm serve`` with ``flags``; its log goes to ``log_path``."""

    def __init__(
        self, flags: list[str], log_path: str | os.PathLike, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._log: IO[Any] = open(self.log_path, "w")  # noqa: SIM115 - closed in wait()
        cmd = [
            sys.executable,
            "-m",
            "radixlm.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_healthy(self, timeout: float = 180.0, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.wait(timeout)
