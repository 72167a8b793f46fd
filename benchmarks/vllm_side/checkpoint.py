"""One checkpoint both systems load, saved in the dtype under test.

vLLM takes the model's dtype from ``config.json`` unless told; both systems are also given
``dtype`` explicitly. The copy lives under radixlm's cache (``vllm-side/``), is built in a
temporary directory and renamed into place, and is reused while its source is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def _source_key(src: Path) -> str:
    h = hashlib.sha256(str(src.resolve()).encode())
    for f in sorted(src.iterdir()):
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def _write_copy(src: Path, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = dtype
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    target = getattr(torch, dtype)
    for f in src.glob("*.safetensors"):
        tensors = {k: v.to(target).contiguous() for k, v in load_file(str(f)).items()}
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})


def checkpoint_in(src: str | os.PathLike, dtype: str, cache: Path) -> Path:
    """``src`` (a Hugging Face directory with safetensors weights) saved in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtypes: each must be one of {DTYPES}, got {dtype!r}")
    src = Path(src)
    from radixlm.tiny_model import build_directory_once  # here: vLLM's worker imports this module

    path = cache / "vllm-side" / f"{src.name}-{_source_key(src)}-{dtype}"
    return build_directory_once(path, lambda tmp: _write_copy(src, tmp, dtype))


def vocab_size(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["vocab_size"])
