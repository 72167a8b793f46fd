"""Offline rounds: each system in its own subprocess (``worker.py``), results as JSON."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from vllm_side.checkpoint import vocab_size
from vllm_side.systems import REPO_DIR, Setup, kv_gib, own_tmpdir, python_and_env
from vllm_side.worker import RESULT_PREFIX
from vllm_side.workloads import SCHEMA

logger = logging.getLogger(__name__)
WORKER_TIMEOUT_S = 3600


def parse_result(stdout: str) -> dict:
    """The worker's result line (the last one with ``RESULT_PREFIX``)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("no result line in the worker's output")


def run_worker(system: str, setup: Setup, model: Path, dtype: str, workloads: list[str],
               seed: int, log_path: Path) -> dict:
    """One round of ``workloads`` on ``system``; its stderr (and stdout) go to
    ``log_path``."""
    config = json.loads((model / "config.json").read_text())
    spec = {"system": system, "model": str(model), "dtype": dtype, "threads": setup.threads,
            "workloads": workloads, "vocab": vocab_size(model), "seed": seed,
            "kv_tokens": setup.kv_tokens,
            "profile_dir": setup.profile_dir if system == "vllm" else None}
    python, env = python_and_env(system, setup, kv_gib(setup.kv_tokens, config, dtype))
    with own_tmpdir(env) as env:
        proc = subprocess.run([python, "-m", "vllm_side.worker", json.dumps(spec)], env=env,
                              cwd=REPO_DIR, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S, check=False)
    with open(log_path, "a") as f:
        f.write(f"=== {system} {dtype} {workloads}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"{system} worker exited {proc.returncode} (log {log_path}):\n"
                           f"{tail}")
    return parse_result(proc.stdout)


def count_valid(texts: list[str]) -> int:
    """Outputs that parse as JSON and validate against the workload's schema."""
    import jsonschema

    valid = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid
