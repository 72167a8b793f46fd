"""SGLang's real code, for compatibility tests: the sglang 0.5 wheel, downloaded once per
machine with ``pip download --no-deps`` and unpacked (nothing of it is installed).

``sglang_dir()`` is the unpacked package directory (``.../sglang``), for reading
``srt/managers/io_struct.py`` and ``srt/sampling/sampling_params.py``;
``import_sglang_lang()`` imports SGLang's frontend (``sglang.lang``) from it without
importing ``sglang/__init__`` (which pulls in the whole server runtime).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

SGLANG_VERSION = os.environ.get("RADIXLM_SGLANG_VERSION", "0.5.23")
CACHE = Path(os.environ.get("RADIXLM_CACHE_DIR", Path.home() / ".cache" / "radixlm"))


def sglang_root() -> Path:
    """The directory that holds the unpacked ``sglang`` package (downloaded if needed, once
    per machine: under a file lock, since the suite's workers run files in parallel)."""
    root = CACHE / f"sglang-{SGLANG_VERSION}"
    if (root / "sglang" / "lang" / "api.py").exists():
        return root
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"sglang-{SGLANG_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "sglang" / "lang" / "api.py").exists():  # unpacked while we waited
            return root
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"sglang=={SGLANG_VERSION}", "-d", str(wheels)], check=True)
            found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        tmp = root.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # left by a process that was killed
        with zipfile.ZipFile(found[0]) as zf:
            zf.extractall(tmp, [m for m in zf.namelist() if m.startswith("sglang/")])
        shutil.rmtree(root, ignore_errors=True)  # an incomplete one
        tmp.rename(root)
    return root


def sglang_dir() -> Path:
    return sglang_root() / "sglang"


def import_sglang_lang() -> types.ModuleType:
    """``sglang.lang`` from the wheel, with ``sglang`` itself an empty namespace module so
    that its server runtime is never imported."""
    pkg = sglang_dir()
    if "sglang" not in sys.modules:
        mod = types.ModuleType("sglang")
        mod.__path__ = [str(pkg)]
        sys.modules["sglang"] = mod
    import importlib

    return importlib.import_module("sglang.lang")
