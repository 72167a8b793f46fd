"""Served rounds: ``radixlm serve`` and llama.cpp's server on loopback ports, each driven by
``radixlm bench serve`` (``/v1/completions``, greedy, streamed, the ``random`` dataset with
fixed lengths, the tokenizer of the Hugging Face directory the GGUF file was made from) at
fixed request rates; one record per rate.

llama.cpp's server is the binding's (``python -m llama_cpp.server``): the llama-server binary
is not part of ``llama-cpp-python``. It runs one request at a time (its lock) and, by
default, ends a streaming request as soon as another one waits (``interrupt_requests``): it
is started with that off, so every request runs to its length and the queue shows in TTFT.
It ignores ``ignore_eos``; ``min_tokens`` (its own field) holds EOS back for the same effect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_side.served import KEEP, ServedLoad, bench_command
from vllm_side.served import Server as _Server

from llamacpp_side.workers import REPO_DIR, Tools, llama_env, radixlm_env
from radixlm.runtime.entrypoints.server_process import free_port

HEALTH_TIMEOUT_S = 600.0


class Server(_Server):
    """A server process in a session of its own; ready once ``/v1/models`` answers (both
    servers have it; the binding's has no ``/health``)."""

    health_path = "/v1/models"

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        super().wait_healthy(timeout)


@dataclass(frozen=True)
class Served:
    """What a served round needs besides the load."""

    tools: Tools
    kv_tokens: int
    radixlm_dtype: str | None  # the Hugging Face directory's dtype; None: the GGUF file


def server_command(system: str, served: Served, model: Path, load: ServedLoad,
                   port: int) -> list[str]:
    threads = str(served.tools.threads)
    if system == "radixlm":
        return [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1",
                "--port", str(port), "--model-path", str(model), "--cpu-threads", threads,
                "--max-total-tokens", str(served.kv_tokens), "--random-seed", "0",
                *(["--dtype", served.radixlm_dtype] if served.radixlm_dtype else [])]
    n_ctx = load.input_len + load.output_len + 64
    return [str(served.tools.python), "-m", "llama_cpp.server", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(model), "--n_threads", threads,
            "--n_threads_batch", threads, "--n_ctx", str(n_ctx),
            "--interrupt_requests", "False", "--verbose", "False"]


def client_command(system: str, url: str, tokenizer: Path, load: ServedLoad, rate: float,
                   seed: int, out_file: Path) -> list[str]:
    cmd = bench_command(url, tokenizer, load, rate, seed, out_file)
    if system == "llamacpp":
        cmd += ["--extra-request-body", json.dumps({"min_tokens": load.output_len})]
    return cmd


def run_served(system: str, served: Served, model: Path, tokenizer: Path, load: ServedLoad,
               log_path: Path) -> dict[str, dict]:
    """``{rate: record}`` for one system: one server, every rate in turn (rate i gets
    dataset seed 1 + i, the same for both systems)."""
    env = (radixlm_env(served.tools.threads) if system == "radixlm"
           else llama_env(served.tools))
    server = Server(server_command(system, served, model, load, free_port()), env, log_path)
    results = {}
    try:
        server.wait_healthy()
        for i, rate in enumerate(load.rates):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "runs.jsonl"
                bench_env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
                proc = subprocess.run(
                    client_command(system, server.url, tokenizer, load, rate, 1 + i, out),
                    env=bench_env, cwd=REPO_DIR, capture_output=True, text=True, check=False)
                with open(log_path, "a") as f:
                    f.write(f"=== bench {system} {model} rate {rate}\n{proc.stdout}"
                            f"{proc.stderr}\n")
                if not out.exists():
                    raise RuntimeError(f"bench serve against {system} wrote no record "
                                       f"(exit {proc.returncode}), see {log_path}")
                record = json.loads(out.read_text().splitlines()[-1])
            results[f"{rate:g}"] = {k: record.get(k) for k in KEEP}
    finally:
        server.stop()
    return results
