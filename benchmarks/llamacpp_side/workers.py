"""Running the two workers, each under its own interpreter, and reading their result line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llamacpp_side.protocol import parse_result
from radixlm.tiny_model import cache_dir

BENCH_DIR = Path(__file__).resolve().parent.parent  # benchmarks/
REPO_DIR = BENCH_DIR.parent
TIMEOUT_S = 3600


@dataclass(frozen=True)
class Tools:
    """Where llama.cpp lives here: the binding's venv and the sdist's llama.cpp tree."""

    venv: Path
    llama_cpp_src: Path  # .../vendor/llama.cpp, with convert_hf_to_gguf.py and gguf-py
    threads: int = 2

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def check(self) -> None:
        if not self.python.exists():
            raise RuntimeError(f"no llama.cpp venv at {self.venv}: pip install "
                               "llama-cpp-python==0.3.36 into it (it builds llama.cpp)")
        if not (self.llama_cpp_src / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(
                f"no convert_hf_to_gguf.py in {self.llama_cpp_src}: pip download "
                "llama-cpp-python==0.3.36 --no-deps --no-binary :all: and unpack it under "
                f"{cache_dir() / 'llamacpp-src'}")

    def check_server(self) -> None:
        """The binding's server imports (it needs the ``[server]`` extra's packages)."""
        probe = subprocess.run([str(self.python), "-c", "import llama_cpp.server.app"],
                               capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            raise RuntimeError(
                f"llama_cpp.server does not import in {self.venv} "
                f"({probe.stderr.strip().splitlines()[-1:]}): {self.python} -m pip install "
                "'llama-cpp-python[server]==0.3.36'")


def llama_env(tools: Tools) -> dict[str, str]:
    """The environment of a process under the llama.cpp venv: only benchmarks/ on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(BENCH_DIR), OMP_NUM_THREADS=str(tools.threads))
    return env


def run_llama_worker(tools: Tools, spec: dict, log_path: Path | None = None,
                     timeout: float = TIMEOUT_S) -> dict:
    """``llama_worker`` under the llama.cpp venv with ``spec``; its result."""
    proc = subprocess.run([str(tools.python), "-m", "llamacpp_side.llama_worker"],
                          input=json.dumps(spec), env=llama_env(tools), capture_output=True,
                          text=True, timeout=timeout, check=False)
    return _result("llama.cpp worker", spec.get("mode"), proc, log_path)


def _result(what: str, mode: str | None, proc: subprocess.CompletedProcess,
            log_path: Path | None) -> dict:
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"=== {what} {mode}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"{what} ({mode}) exited {proc.returncode}:\n{tail}")
    return parse_result(proc.stdout)


def radixlm_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{REPO_DIR}{os.pathsep}{BENCH_DIR}", OMP_NUM_THREADS=str(threads))
    return env


def run_radixlm_worker(spec: dict, log_path: Path | None = None,
                       timeout: float = TIMEOUT_S) -> dict:
    """``radixlm_worker`` under this interpreter with ``spec``; its result."""
    proc = subprocess.run([sys.executable, "-m", "llamacpp_side.radixlm_worker"],
                          input=json.dumps(spec), env=radixlm_env(spec["threads"]),
                          cwd=REPO_DIR, capture_output=True, text=True, timeout=timeout,
                          check=False)
    return _result("radixlm worker", spec.get("mode"), proc, log_path)
