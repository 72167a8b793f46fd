"""OpenMP's wait policy for radixlm's compute processes, set before torch loads OpenMP.

Unless told otherwise, libgomp (torch's OpenMP) makes its threads spin 300,000 times (a
few milliseconds) at every barrier before they sleep. When one of them shares its core with
another process it holds up every parallel region while the others burn their cores
spinning: with one of two cores busy, two spinning threads made radixlm 10-20x slower.
libgomp reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when torch loads it, so
``set_openmp_defaults`` runs from ``radixlm/__init__.py`` before anything imports torch; it
sets ``GOMP_SPINCOUNT`` (a short spin, then sleep) unless the user set either variable.
Child processes (scheduler, tensor-parallel ranks, Engine replicas) inherit it and import
radixlm first. In a process that imported torch before radixlm it is too late: there
``wait_policy()`` says so. This module must not import torch.
"""

from __future__ import annotations

import os
import sys

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# about 0.5 ms of spinning: covers the gaps between the parallel regions of one step on a
# free machine (1,000 did not: bf16 on the small preset ran at 0.81x libgomp's default
# 300,000 when idle, 10,000 at 0.99x; benchmarks/shared_machine.py), and a thread whose
# partner core is busy gives its core up soon after
DEFAULT_SPINCOUNT = "10000"
OPENMP_LIBS = ("libgomp", "libiomp", "libomp")

_wait_at_load: str | None = None  # what this process's OpenMP read when it loaded


def openmp_loaded() -> bool:
    """Whether an OpenMP runtime is mapped into this process already (then it has read
    its environment and changing the variables no longer matters here)."""
    try:
        with open("/proc/self/maps") as f:
            return any(lib in line for line in f for lib in OPENMP_LIBS)
    except OSError:
        return "torch" in sys.modules


def _describe_env() -> str:
    set_vars = [f"{k}={os.environ[k]}" for k in WAIT_ENV if k in os.environ]
    return ", ".join(set_vars) or "libgomp default (spin 300000)"


def set_openmp_defaults() -> str:
    """Set ``GOMP_SPINCOUNT=DEFAULT_SPINCOUNT`` in this process's environment (so in its
    children's too) unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set already.
    Returns the wait policy this process's OpenMP runs with (see ``wait_policy``)."""
    global _wait_at_load
    loaded = openmp_loaded()
    if not any(k in os.environ for k in WAIT_ENV):
        os.environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
    if _wait_at_load is None:
        _wait_at_load = (f"unknown: OpenMP loaded before radixlm (environment now: "
                         f"{_describe_env()})" if loaded else _describe_env())
    return _wait_at_load


def wait_policy() -> str:
    """How this process's OpenMP threads wait, as far as radixlm can tell."""
    return _wait_at_load or set_openmp_defaults()
