"""The agent frameworks a user points at radixlm's OpenAI API — the Agents SDK, LangChain,
LiteLLM and instructor — installed once per machine in a virtual environment of their own
under ``~/.cache/radixlm`` (their pins would fight the test venv's), and a way to run a
client script in it against a server.

A script prints one JSON line prefixed ``RESULT `` with what it observed; ``run_client``
returns it parsed, or fails the test with the script's output.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("RADIXLM_CACHE_DIR", Path.home() / ".cache" / "radixlm"))
PACKAGES = ("openai-agents==0.24.0", "langchain-openai==1.7.4", "litellm==1.110.2",
            "instructor==1.17.0")
VENV = CACHE / "agent-frameworks-v1-venv"
RESULT = "RESULT "


def frameworks_python() -> Path:
    """The Python of the frameworks' venv (built once per machine, under a lock, so
    parallel tests build it once; a half-built one is rebuilt)."""
    python, done = VENV / "bin" / "python", VENV / ".installed"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "agent-frameworks-v1.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True,
                           env=env)
            done.touch()
    return python


def run_client(script: str, base_url: str, api_key: str = "EMPTY", timeout: float = 300) -> dict:
    """Run ``script`` (dedented) in the frameworks' venv with ``OPENAI_BASE_URL`` (the
    server's ``/v1``) and ``OPENAI_API_KEY`` set; return its ``RESULT`` JSON."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url.rstrip("/") + "/v1",
           "OPENAI_API_KEY": api_key, "OPENAI_AGENTS_DISABLE_TRACING": "1",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": ""}
    proc = subprocess.run([str(frameworks_python()), "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    pytest.fail(f"client script gave no result (exit {proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
