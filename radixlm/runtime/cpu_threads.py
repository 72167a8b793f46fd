"""How many torch threads a compute process should run on a CPU: the cores it may use,
less those other processes keep busy.

``cpu_budget`` is the process's CPU affinity capped by its cgroup's CPU quota.
``ThreadSizer`` (one per scheduler) starts from ``--cpu-threads`` or the budget and, unless
``--cpu-threads`` was given, sizes the pool again every ``RESIZE_INTERVAL_S`` from
``/proc/stat``: the busy time of the CPUs this process may use, minus this process's own
CPU time, is the other processes' load; every core's worth of it from ``BUSY_FRACTION``
up is a core the pool leaves alone. An OpenMP thread on a core another process also wants
holds up every parallel region of every step (see ``openmp_env.py``), so one thread fewer
is far cheaper than one thread too many. Torch-free: the caller applies the count.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RESIZE_INTERVAL_S = 2.0
BUSY_FRACTION = 0.4  # another process's load counts as a busy core from 0.4 of one up


def _words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


def cgroup_quota_cores() -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None
    when there is none."""
    words = _words("/sys/fs/cgroup/cpu.max")  # "max 100000" or "150000 100000"
    if len(words) != 2:
        words = (_words("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")  # "-1" when unlimited
                 + _words("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    if len(words) != 2 or words[0] in ("max", "-1"):
        return None
    try:
        return int(words[0]) / int(words[1])
    except (ValueError, ZeroDivisionError):
        return None


def cpu_budget() -> int:
    """The cores this process may run on: its CPU affinity, capped by the cgroup quota."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_quota_cores()
    return max(min(cores, math.floor(quota)) if quota is not None else cores, 1)


@dataclass(frozen=True)
class CpuSample:
    """Busy and total jiffies of the CPUs this process may use, and its own CPU time."""

    busy: int
    total: int
    own_s: float
    at: float

    @staticmethod
    def take() -> CpuSample | None:
        cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        busy = total = 0
        try:
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name not in cpus:
                        continue
                    ticks = [int(x) for x in fields[:8]]  # user .. steal
                    idle = ticks[3] + ticks[4]  # idle + iowait
                    busy += sum(ticks) - idle
                    total += sum(ticks)
        except (OSError, ValueError, IndexError):
            return None
        t = os.times()
        return CpuSample(busy, total, t.user + t.system, time.monotonic())


def others_busy_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores' worth of CPU time other processes used between the two samples."""
    wall = after.at - before.at
    if wall <= 0 or after.total <= before.total:
        return 0.0
    hz = os.sysconf("SC_CLK_TCK")
    busy_s = (after.busy - before.busy) / hz
    return max(busy_s - (after.own_s - before.own_s), 0.0) / wall


def busy_to_cores(load: float) -> int:
    """Whole cores taken by ``load`` (a fraction of ``BUSY_FRACTION`` or more counts)."""
    return math.floor(load + 1 - BUSY_FRACTION + 1e-9)


class ThreadSizer:
    """torch's thread count for one compute process.

    ``cpu_threads`` (the user's ``--cpu-threads``) fixes it at ``cpu_threads // share``.
    Otherwise it is ``budget - max(reserved, busy)``, at least 1, where ``busy`` is the
    other processes' load in whole cores (``busy_to_cores``) measured over the last
    ``interval_s``, and ``reserved`` cores are left to this server's other processes (HTTP,
    detokenizer) even when they look idle. ``share`` is how many compute processes split
    the budget (``--dp-size`` replicas x tensor-parallel ranks of this machine); with more
    than one, each keeps ``(budget - reserved) // share`` and is not resized: its siblings'
    load would look like other processes' and they would shrink one another."""

    def __init__(self, cpu_threads: int | None, reserved: int = 0, share: int = 1,
                 interval_s: float = RESIZE_INTERVAL_S) -> None:
        assert share >= 1 and reserved >= 0, (share, reserved)
        self.budget = cpu_budget()
        self.reserved, self.interval_s = reserved, interval_s
        if cpu_threads:
            self.fixed: int | None = max(cpu_threads // share, 1)
        else:
            self.fixed = None if share == 1 else max((self.budget - reserved) // share, 1)
        self.threads = self.fixed or self.target(busy=0)
        self.last_busy = 0.0  # the other processes' load at the last measurement (cores)
        self._sample = CpuSample.take()

    def target(self, busy: int) -> int:
        """The thread count with ``busy`` cores taken by other processes."""
        return max(self.budget - max(self.reserved, busy), 1)

    def resize(self) -> int | None:
        """The new thread count when it should change now, else None. Cheap between
        measurements (one clock read); a measurement reads ``/proc/stat``."""
        if self.fixed is not None or self._sample is None:
            return None
        if time.monotonic() - self._sample.at < self.interval_s:
            return None
        sample = CpuSample.take()
        if sample is None:
            return None
        self.last_busy = others_busy_cores(self._sample, sample)
        self._sample = sample
        threads = self.target(busy_to_cores(self.last_busy))
        if threads == self.threads:
            return None
        logger.info("torch threads %d -> %d (other processes keep %.1f of %d cores busy)",
                    self.threads, threads, self.last_busy, self.budget)
        self.threads = threads
        return threads
