"""Served rounds: each system's OpenAI server on a free loopback port, driven by
``radixlm bench serve`` (``/v1/completions``, greedy, ``ignore_eos``, the ``random``
dataset with fixed lengths) at fixed request rates; one record per rate.

Every rate gets its own dataset seed (the same for both systems), so a later rate's prompts
are not already in the prefix cache from an earlier one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from radixlm.runtime.entrypoints.server_process import free_port
from vllm_side.systems import REPO_DIR, Setup, kv_gib, own_tmpdir, python_and_env, server_command

HEALTH_TIMEOUT_S = 900.0  # vLLM compiles its model on a first start
KEEP = ("completed", "failed", "output_throughput", "request_throughput", "median_ttft_ms",
        "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
        "duration", "total_output_tokens")


@dataclass(frozen=True)
class ServedLoad:
    rates: tuple[float, ...]
    prompts: int
    input_len: int
    output_len: int

    @classmethod
    def from_args(cls, args: Any) -> ServedLoad:
        """From ``--serve-rates`` (comma-separated, each positive), ``--serve-prompts``,
        ``--serve-input-len`` and ``--serve-output-len``; ValueError naming the flag."""
        try:
            rates = tuple(float(r) for r in args.serve_rates.split(","))
        except ValueError:
            raise ValueError(f"--serve-rates: comma-separated numbers, got "
                             f"{args.serve_rates!r}") from None
        if any(not r > 0 for r in rates):
            raise ValueError("--serve-rates must be positive")
        return cls(rates, args.serve_prompts, args.serve_input_len, args.serve_output_len)


class Server:
    """A server process in a session of its own (stopped with its children)."""

    health_path = "/health"  # answers 200 once the server is ready

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO_DIR, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}), see "
                                   f"{self._log.name}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout} s, see {self._log.name}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        self._log.close()


def bench_command(url: str, model: Path, load: ServedLoad, rate: float, seed: int,
                  out_file: Path) -> list[str]:
    return [sys.executable, "-m", "radixlm.cli", "bench", "serve", "--backend", "openai",
            "--base-url", url, "--tokenizer", str(model), "--dataset-name", "random",
            "--num-prompts", str(load.prompts), "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--random-range-ratio", "1",
            "--request-rate", f"{rate:g}", "--seed", str(seed), "--warmup-requests", "2",
            "--disable-tqdm", "--output-file", str(out_file)]


def run_served(system: str, setup: Setup, model: Path, dtype: str, load: ServedLoad,
               log_path: Path) -> dict[str, dict]:
    """``{rate: record}`` for one system: one server, every rate in turn."""
    config = json.loads((model / "config.json").read_text())
    _, env = python_and_env(system, setup, kv_gib(setup.kv_tokens, config, dtype))
    results = {}
    with own_tmpdir(env) as env:  # the server's, removed once it has stopped
        server = Server(server_command(system, setup, model, dtype, free_port()), env, log_path)
        try:
            server.wait_healthy()
            for i, rate in enumerate(load.rates):
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "runs.jsonl"
                    bench_env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
                    proc = subprocess.run(bench_command(server.url, model, load, rate, 1 + i, out),
                                          env=bench_env, cwd=REPO_DIR, capture_output=True,
                                          text=True, check=False)
                    with open(log_path, "a") as f:
                        f.write(f"=== bench {system} {dtype} rate {rate}\n{proc.stdout}"
                                f"{proc.stderr}\n")
                    if not out.exists():
                        raise RuntimeError(f"bench serve against {system} wrote no record "
                                           f"(exit {proc.returncode}), see {log_path}")
                    record = json.loads(out.read_text().splitlines()[-1])
                results[f"{rate:g}"] = {k: record.get(k) for k in KEEP}
        finally:
            server.stop()
    return results
