"""The CPU paged-attention kernel (``csrc/paged_attention.cpp``): K and V read from the
pool in place, no per-step gather.

The C++ source is compiled once per machine with the system's C++ compiler against the
installed torch (``make install`` does it; otherwise the first call does), cached under
``~/.cache/radixlm/kernels/<hash of source, flags and torch version>/`` (or under
``$RADIXLM_CACHE_DIR``) and loaded as the
torch op ``torch.ops.radixlm_cpu.paged_attention``. Where no compiler is found or the
build fails, ``available()`` is False and attention keeps the gathering torch path (the
reason is logged once). ``RADIXLM_CPU_KERNEL=0`` turns the kernel off.

    paged_attention(q [N,Hq,D], k_buf [S,Hkv,D], v_buf, q_rows [M], q_indptr [G+1],
                    kv_indptr [G+1], kv_indices [nnz], sm_scale, causal=False,
                    o_init=None, lse_init=None, sliding_window=None, logit_cap=None)
        -> (o [N,Hq,D], lse [N,Hq])

Segment s: rows ``q_rows[q_indptr[s]:q_indptr[s+1]]`` attend to slots
``kv_indices[kv_indptr[s]:kv_indptr[s+1]]``. Row i of n stands at key position
``p = n_keys - n + i`` (decode: the last key; extend: the new tokens are the last n keys):
with ``causal`` it sees keys ``j <= p``, with ``sliding_window`` W only ``j > p - W``
(transformers' sliding-window mask, when the segment's keys are consecutive positions of
one sequence ending at its rows; the plan sends windows only through such segments).
``logit_cap`` c: scores become ``c * tanh(s / c)`` before the softmax (lse is over the
capped scores). o and lse are float32; the pool may hold any of ``KV_DTYPES`` (widened
to float32 as loaded). q is float32, or bfloat16: where ``amx()``, a bf16 q over a bf16
pool is multiplied on AMX tiles in every task with at least 16 rows per KV head (query
rows x the heads of a group; ``csrc/amx_attention.cpp``), its products rounded as torch's
bf16 attention rounds them; elsewhere it is widened to float32. A float32 q, where
``packed()``, takes the packed path in every task with at least ``packed_min_rows`` rows
per KV head and ``packed_min_keys`` keys (torch ops of those names; ``csrc/
packed_attention.cpp``: each block of keys transposed once for all of the task's rows,
whose scores are then outer products); ``RADIXLM_CPU_PACKED=0`` keeps it on the FMA path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# every C++ file of csrc/ goes into the one library (fused_layers.cpp: see cpu_fused.py)
SOURCES = sorted(SOURCE.parent.glob("*.cpp"))
# K/V pool dtypes the kernel reads (converted to float32 as loaded; q and o are float32)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2)
# Reassociation lets the compiler vectorise the reductions. Not -ffast-math: linking with
# it adds crtfastmath.o, which turns on flush-to-zero for the whole process when the
# library loads (Python's own float arithmetic would change); and finite-math must stay
# off because -inf marks empty rows and the running max starts there.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-std=c++17", "-fPIC"]


def _cache_dir() -> Path:
    base = Path(os.environ.get("RADIXLM_CACHE_DIR", Path.home() / ".cache" / "radixlm"))
    sources = b"".join(f.read_bytes() for f in sorted(SOURCE.parent.iterdir()))
    key = hashlib.sha256(sources + " ".join(FLAGS).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    return base / "kernels" / key


def _jobs() -> int:
    """Compilers run at once: one per core this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # the errors first: warnings about torch's headers bury them
        errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
        raise RuntimeError(f"{what} failed:\n" + "\n".join(errors[:20] or [proc.stderr[-2000:]]))


def _compile(out: Path) -> None:
    """Each source to an object, up to ``_jobs()`` compilers at once (torch's headers make
    most of each one's time), then one link into ``out``."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                   "-DTORCH_API_INCLUDE_EXTENSION_H",
                   *(f"-I{p}" for p in cpp_extension.include_paths())]
    with tempfile.TemporaryDirectory(prefix="objects.", dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        # the largest sources first, so the longest compile does not start last
        order = sorted(zip(SOURCES, objects), key=lambda so: -so[0].stat().st_size)
        with ThreadPoolExecutor(max_workers=_jobs()) as pool:
            builds = [pool.submit(_run, [*compile_cmd, "-c", str(src), "-o", str(obj)],
                                  f"{cxx} {src.name}") for src, obj in order]
            try:
                for b in builds:
                    b.result()
            except BaseException:  # a source failed: the ones not started are not needed
                for b in builds:
                    b.cancel()
                raise
        _run([cxx, *FLAGS, "-shared", *map(str, objects), f"-L{lib}", "-lc10", "-ltorch_cpu",
              f"-Wl,-rpath,{lib}", "-o", str(out)], f"{cxx} (link)")


def build() -> Path:
    """The compiled library, built now if this machine has none (under a file lock, so
    concurrent processes build it once)."""
    d = _cache_dir()
    so = d / "paged_attention.so"
    if so.exists():
        return so
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not so.exists():
            tmp = d / f"paged_attention.{os.getpid()}.so"
            logger.info("compiling the CPU attention kernel into %s", d)
            _compile(tmp)
            tmp.rename(so)
    return so


@cache
def available() -> bool:
    """Whether the kernel is loaded (compiling it on first use)."""
    if os.environ.get("RADIXLM_CPU_KERNEL", "1") == "0":
        return False
    try:
        torch.ops.load_library(str(build()))
    except Exception as e:  # no compiler, or a failed build: keep the torch path
        logger.warning("CPU attention kernel unavailable, using the gathering torch path: %s",
                       e)
        return False
    return True


@cache
def bf16_kernels_on() -> bool:
    """The kernel is loaded and ``RADIXLM_CPU_AMX=0`` has not turned its bfloat16 paths off
    (the attention's tiles, ``amx``, and the decode linears, ``amx_linear``)."""
    return available() and os.environ.get("RADIXLM_CPU_AMX", "1") != "0"


@cache
def amx() -> bool:
    """Whether the kernel multiplies a bfloat16 q over a bfloat16 pool on AMX-BF16 tiles
    (``csrc/amx_attention.cpp``: the library built for a CPU with AMX, and the OS granting
    its tiles; on a CPU with AVX512-BF16 and no AMX, the same packing with the products on
    VDPBF16PS); ``RADIXLM_CPU_AMX=0`` keeps such rows on the float32 FMA path."""
    return bf16_kernels_on() and bool(torch.ops.radixlm_cpu.bf16_tiles_ready())


@cache
def packed() -> bool:
    """Whether a float32 q with rows enough takes the kernel's packed path (a build with
    AVX-512, or AVX2 with FMA and F16C, and ``RADIXLM_CPU_PACKED`` not 0)."""
    return available() and bool(torch.ops.radixlm_cpu.packed_on())


def paged_attention(q, k_buf, v_buf, q_rows, q_indptr, kv_indptr, kv_indices, sm_scale,
                    causal=False, o_init=None, lse_init=None, sliding_window=None,
                    logit_cap=None):
    """(o, lse); with ``o_init`` / ``lse_init`` (an earlier pass's), continued from them;
    ``sliding_window`` / ``logit_cap`` as in the module doc (None: none)."""
    return torch.ops.radixlm_cpu.paged_attention(q, k_buf, v_buf, q_rows, q_indptr, kv_indptr,
                                                 kv_indices, float(sm_scale), bool(causal),
                                                 o_init, lse_init, int(sliding_window or 0),
                                                 float(logit_cap or 0.0))


if __name__ == "__main__":  # `python -m radixlm.kernels.cpu_paged`: build now (make install)
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if available() else 1)
