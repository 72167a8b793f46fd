"""The checkpoints and the GGUF files both systems load, built once under radixlm's cache.

- ``small``: the built-in small preset (hidden 768, 12 layers, 12/4 heads, 32k vocabulary).
- ``1b``: a 1B-class Llama shape (hidden 2,048, 16 layers, 32/8 heads of 64, intermediate
  8,192, 32k vocabulary: Llama 3.2 1B's shape with a smaller vocabulary), seeded random
  weights from ``radixlm.tiny_model`` like every built-in model.

Each Hugging Face directory is turned into ``BF16.gguf`` by llama.cpp's own
``convert_hf_to_gguf.py`` (``convert.py``: run from the ``llama-cpp-python`` sdist's
``vendor/llama.cpp``), and that file into ``Q8_0.gguf`` and ``Q4_K_M.gguf`` by llama.cpp's
quantizer through the binding (``llama_worker`` ``quantize``), as a llama.cpp user makes
them. Every file is written under a temporary name and renamed into place, so a run cut
short leaves no half file to be reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llamacpp_side.workers import BENCH_DIR, TIMEOUT_S, Tools, run_llama_worker
from radixlm.tiny_model import (
    ModelShape,
    build_directory_once,
    cache_dir,
    default_tiny_model_path,
    make_tiny_model,
)

MODELS = ("small", "1b")
FORMATS = ("BF16", "Q8_0", "Q4_K_M")  # the default set
# one block type each (Q4_K_M mixes Q4_K and Q6_K): to tell which one two systems part on
MORE_FORMATS = ("Q4_0", "Q4_K_S", "Q5_K_M", "Q6_K")
SHAPE_1B = ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                      intermediate=8192, vocab=32000)
SDIST = "llama_cpp_python-0.3.36"


def default_tools(threads: int = 2) -> Tools:
    base = cache_dir()
    return Tools(base / "llamacpp-venv",
                 base / "llamacpp-src" / SDIST / "vendor" / "llama.cpp", threads)


def hf_model(name: str) -> Path:
    """The Hugging Face directory of ``name`` (one of MODELS), built on first use."""
    if name == "small":
        return default_tiny_model_path(preset="small")
    if name == "1b":
        return build_directory_once(cache_dir() / "llama-1b-class-v1",
                                    lambda tmp: make_tiny_model(tmp, shape=SHAPE_1B))
    raise ValueError(f"--models: each must be one of {MODELS}, got {name!r}")


def vocab_size(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def _convert(tools: Tools, hf_dir: Path, out: Path, log_path: Path | None) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH_DIR)}
    proc = subprocess.run([sys.executable, "-m", "llamacpp_side.convert",
                           str(tools.llama_cpp_src), str(hf_dir), str(out), "bf16"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"=== convert {hf_dir} -> {out}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py exited {proc.returncode}:\n{tail}")


def gguf_file(tools: Tools, hf_dir: Path, fmt: str, out_dir: Path,
              log_path: Path | None = None) -> Path:
    """``out_dir/<fmt>.gguf`` of ``hf_dir``, made by llama.cpp's tools unless it exists."""
    if fmt not in FORMATS + MORE_FORMATS:
        raise ValueError(f"--formats: each must be one of {FORMATS + MORE_FORMATS}, "
                         f"got {fmt!r}")
    path = out_dir / f"{fmt}.gguf"
    if path.is_file():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{fmt}.{os.getpid()}.gguf"
    try:
        if fmt == "BF16":
            _convert(tools, hf_dir, tmp, log_path)
        else:
            src = gguf_file(tools, hf_dir, "BF16", out_dir, log_path)
            run_llama_worker(tools, {"mode": "quantize", "src": str(src), "out": str(tmp),
                                     "ftype": fmt, "threads": tools.threads}, log_path)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def gguf_dir(hf_dir: Path) -> Path:
    return cache_dir() / "llamacpp-side" / hf_dir.name
