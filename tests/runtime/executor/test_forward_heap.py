"""glibc's malloc during a CPU forward (forward_heap.py): large activations come from the
heap, which keeps them for the next forward; the user's own malloc settings stand."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys

import pytest
import torch

from radixlm.runtime.executor.forward_heap import ForwardHeap, user_tuned_malloc

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
BLOCK = 80 << 20  # a float32 gate/up product of 2,048 rows at the Qwen2.5-0.5B shape


def _faults_to_fill(nbytes: int) -> int:
    """Minor page faults taken to allocate, write and free a block of ``nbytes``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del t
    return faults


def _mapping_of_a_block(nbytes: int) -> str:
    """The name of the mapping that holds a new block of ``nbytes`` ('' for an anonymous
    one of its own; '[heap]' for the brk heap)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{t.data_ptr():#x} is in no mapping")


def _check_reuse() -> None:
    """Run in a fresh process (``test_a_large_block_...``)."""
    heap = ForwardHeap(True)
    assert heap.on
    # glibc maps a block this large by itself (above its largest mmap threshold, 32 MiB) and
    # unmaps it when freed: every block faults in afresh
    assert _mapping_of_a_block(BLOCK) != "[heap]"
    assert _faults_to_fill(BLOCK) > BLOCK // 4096 // 2
    with heap:  # the brk heap (this runs on the main thread), which keeps its pages
        _faults_to_fill(BLOCK)
        # the next forward's blocks land in those pages (a smaller one here: a block of the
        # same size may land past a small one placed at the old one's start meanwhile)
        again = _faults_to_fill(BLOCK // 2)
        assert _mapping_of_a_block(BLOCK) == "[heap]"
    assert again < BLOCK // 4096 // 20, again  # a fresh mapping: 10,240 faults


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_a_large_block_freed_in_a_forward_is_reused_without_page_faults():
    """In a process of its own: one that ran other tests first may hold a free chunk of its
    heap as large as the block (kept there by an earlier runner's trim threshold), which
    glibc then serves the block from outside a forward too."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES",
                        "LD_PRELOAD")}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_users_malloc_settings_stand(monkeypatch):
    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    assert user_tuned_malloc() is None
    for name, value in (("MALLOC_TRIM_THRESHOLD_", "1000000"),
                        ("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0"),
                        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert user_tuned_malloc() == name
            assert not ForwardHeap(True).on
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # not malloc's
    assert user_tuned_malloc() is None
    off = ForwardHeap(False)
    assert not off.on
    with off:  # a no-op
        pass


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_the_engine_flag(make_engine):
    assert make_engine().scheduler.model_runner.heap.on
    runner = make_engine(disable_cpu_malloc_cache=True).scheduler.model_runner
    assert not runner.heap.on


if __name__ == "__main__":  # test_a_large_block_freed_in_a_forward_is_reused_...
    _check_reuse()
