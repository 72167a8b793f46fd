"""How each system is started: interpreter, environment, server command.

radixlm runs under this Python with the worktree on ``PYTHONPATH``; vLLM under its venv's
Python with only this package on it. Both get the same number of threads: radixlm through
``cpu_threads`` (torch.set_num_threads) and ``OMP_NUM_THREADS``; vLLM's CPU worker through
``VLLM_CPU_OMP_THREADS_BIND`` (its OpenMP threads, one per listed core, bound), its KV
cache through ``VLLM_CPU_KVCACHE_SPACE`` (GiB). Each process gets a temporary directory
of its own (``TMPDIR``), removed when it has stopped: vLLM leaves its IPC sockets
(``ipc://<tmp>/<uuid>``, seven a start) and ``vllm_dist_*`` files there.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SYSTEMS = ("radixlm", "vllm")
BENCH_DIR = Path(__file__).resolve().parent.parent  # benchmarks/
REPO_DIR = BENCH_DIR.parent


@dataclass(frozen=True)
class Setup:
    """What both systems share in a run."""

    threads: int
    kv_tokens: int  # radixlm's pool; vLLM gets the same bytes (kv_gib)
    vllm_python: str
    vllm_bind: str = "cores"  # "cores": the first `threads` cores this process may use
    profile_dir: str | None = None

    def bind_mask(self) -> str:
        if self.vllm_bind != "cores":
            return self.vllm_bind
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < self.threads:
            raise ValueError(f"--threads {self.threads}: only {len(cores)} cores available")
        return ",".join(str(c) for c in cores[: self.threads])


def kv_gib(kv_tokens: int, config: dict, dtype: str) -> int:
    """Whole GiB holding ``kv_tokens`` of K and V for every layer (at least 1)."""
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * (
        4 if dtype == "float32" else 2)
    return max(1, math.ceil(kv_tokens * per_token / 2**30))


def python_and_env(system: str, setup: Setup, kv_gib_: int) -> tuple[str, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if system == "radixlm":
        env.update(PYTHONPATH=f"{REPO_DIR}{os.pathsep}{BENCH_DIR}",
                   OMP_NUM_THREADS=str(setup.threads))
        return sys.executable, env
    if system != "vllm":
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    # vLLM sets its CPU worker's OMP_NUM_THREADS from the bind list; an inherited one would
    # also give its scheduler process that many torch threads
    for name in ("VIRTUAL_ENV", "OMP_NUM_THREADS"):
        env.pop(name, None)
    env.update(PYTHONPATH=str(BENCH_DIR), VLLM_CPU_OMP_THREADS_BIND=setup.bind_mask(),
               VLLM_CPU_KVCACHE_SPACE=str(kv_gib_),
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
    return setup.vllm_python, env


@contextlib.contextmanager
def own_tmpdir(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with ``TMPDIR`` a fresh directory, removed (with what the process left in
    it) when the block ends: run the process to its end inside."""
    with tempfile.TemporaryDirectory(prefix="vllm-side-") as tmp:
        yield {**env, "TMPDIR": tmp}


def server_command(system: str, setup: Setup, model: Path, dtype: str, port: int
                   ) -> list[str]:
    """The OpenAI server on 127.0.0.1:``port`` (prefix caching on in both)."""
    if system == "radixlm":
        return [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1",
                "--port", str(port), "--model-path", str(model), "--dtype", dtype,
                "--cpu-threads", str(setup.threads), "--max-total-tokens",
                str(setup.kv_tokens), "--random-seed", "0"]
    return [setup.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--host",
            "127.0.0.1", "--port", str(port), "--model", str(model), "--dtype", dtype,
            "--enable-prefix-caching", "--seed", "0"]
