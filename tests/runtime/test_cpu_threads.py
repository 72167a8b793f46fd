"""Thread sizing and OpenMP's wait policy: the arithmetic on synthetic CPU samples, the
environment a process gets from ``import radixlm``, and what a server's scheduler process
actually runs with (its /proc environ and ``get_server_info``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests
import torch

from radixlm.runtime import cpu_threads
from radixlm.runtime.cpu_threads import CpuSample, ThreadSizer, busy_to_cores, others_busy_cores
from radixlm.runtime.openmp_env import DEFAULT_SPINCOUNT, WAIT_ENV

HZ = os.sysconf("SC_CLK_TCK")


def sample(busy_s: float, own_s: float, at: float) -> CpuSample:
    return CpuSample(busy=round(busy_s * HZ), total=round(at * HZ) * 8, own_s=own_s, at=at)


def test_others_busy_is_machine_busy_minus_own_time() -> None:
    before, after = sample(0, 0, 10.0), sample(3.0, 1.0, 12.0)  # 2 s: 3 s busy, 1 s ours
    assert others_busy_cores(before, after) == pytest.approx(1.0, abs=0.01)
    assert others_busy_cores(after, after) == 0.0  # no time passed
    assert others_busy_cores(sample(0, 0, 1.0), sample(1.0, 1.5, 2.0)) == 0.0  # never < 0


@pytest.mark.parametrize(("load", "cores"), [(0.0, 0), (0.39, 0), (0.4, 1), (1.0, 1),
                                             (1.39, 1), (1.5, 2)])
def test_busy_to_cores(load: float, cores: int) -> None:
    assert busy_to_cores(load) == cores


@pytest.mark.parametrize(("words", "quota"), [
    ({"/sys/fs/cgroup/cpu.max": ["max", "100000"]}, None),
    ({"/sys/fs/cgroup/cpu.max": ["150000", "100000"]}, 1.5),
    ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": ["-1"],
      "/sys/fs/cgroup/cpu/cpu.cfs_period_us": ["100000"]}, None),
    ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": ["300000"],
      "/sys/fs/cgroup/cpu/cpu.cfs_period_us": ["100000"]}, 3.0),
    ({}, None),
])
def test_cgroup_quota(monkeypatch: pytest.MonkeyPatch, words: dict, quota: float | None) -> None:
    monkeypatch.setattr(cpu_threads, "_words", lambda path: words.get(path, []))
    assert cpu_threads.cgroup_quota_cores() == quota


def test_budget_is_affinity_capped_by_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_threads, "cgroup_quota_cores", lambda: None)
    assert cpu_threads.cpu_budget() == 4
    monkeypatch.setattr(cpu_threads, "cgroup_quota_cores", lambda: 2.5)
    assert cpu_threads.cpu_budget() == 2
    monkeypatch.setattr(cpu_threads, "cgroup_quota_cores", lambda: 0.5)
    assert cpu_threads.cpu_budget() == 1


def sizer_on(monkeypatch: pytest.MonkeyPatch, samples: list[CpuSample], **kwargs) -> ThreadSizer:
    """A sizer over a 4-core budget whose CPU samples are ``samples``, in order; the clock
    reads the time of the sample to come."""
    monkeypatch.setattr(cpu_threads, "cpu_budget", lambda: 4)
    pending = list(samples)
    monkeypatch.setattr(CpuSample, "take", staticmethod(lambda: pending.pop(0)))
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: pending[0].at)
    return ThreadSizer(**kwargs)


def test_sizer_shrinks_and_grows_with_other_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # other processes: 0 cores, then 2 cores (8 s busy of which 4 s ours over 2 s), then 0
    samples = [sample(0, 0, 0.0), sample(0.2, 0.2, 2.0), sample(8.2, 4.2, 4.0),
               sample(12.2, 8.2, 6.0)]
    sizer = sizer_on(monkeypatch, samples, cpu_threads=None, interval_s=1.0)
    assert sizer.threads == 4
    assert sizer.resize() is None  # idle machine: stays
    assert sizer.resize() == 2 and sizer.last_busy == pytest.approx(2.0, abs=0.01)
    assert sizer.resize() == 4


def test_sizer_reserves_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # one core busy elsewhere, then two
    samples = [sample(0, 0, 0.0), sample(2.0, 0, 2.0), sample(6.0, 0, 4.0)]
    sizer = sizer_on(monkeypatch, samples, cpu_threads=None, reserved=1, interval_s=1.0)
    assert sizer.threads == 3
    assert sizer.resize() is None  # the busy core is the reserved one
    assert sizer.resize() == 2
    assert sizer.target(busy=5) == 1  # never fewer than one


def test_sizer_with_siblings_keeps_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    # two replicas (or ranks): each one's load would look like the other's "other load"
    samples = [sample(0, 0, 0.0), sample(4.0, 1.0, 2.0)]
    sizer = sizer_on(monkeypatch, samples, cpu_threads=None, reserved=1, share=2,
                     interval_s=1.0)
    assert sizer.threads == 1 == sizer.fixed  # (4 - 1) // 2
    assert sizer.resize() is None


def test_sizer_fixed_by_cpu_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [sample(0, 0, 0.0), sample(8.0, 0, 2.0)]
    sizer = sizer_on(monkeypatch, samples, cpu_threads=6, share=2, interval_s=1.0)
    assert sizer.threads == 3
    assert sizer.resize() is None  # --cpu-threads always wins
    assert sizer.fixed == 3


def test_sizer_waits_for_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [sample(0, 0, 0.0), sample(8.0, 0, 2.0)]
    sizer = sizer_on(monkeypatch, samples, cpu_threads=None, interval_s=5.0)
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: 2.0)
    assert sizer.resize() is None  # 2 s < 5 s: no sample taken
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: 5.0)
    assert sizer.resize() == 1  # then the next sample: 4 cores busy elsewhere


def run_python(code: str, env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_ENV}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


PROBE = ("import os, json; {first}"
         "from radixlm.runtime.openmp_env import wait_policy; "
         "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), "
         "os.environ.get('OMP_WAIT_POLICY'), wait_policy()]))")


def test_import_radixlm_sets_a_short_spin_before_torch() -> None:
    spin, policy, seen = json.loads(run_python(PROBE.format(first="import radixlm; "), {}))
    assert (spin, policy) == (DEFAULT_SPINCOUNT, None)
    assert seen == f"GOMP_SPINCOUNT={DEFAULT_SPINCOUNT}"


def test_user_wait_policy_wins() -> None:
    spin, policy, seen = json.loads(run_python(PROBE.format(first="import radixlm; "),
                                               {"OMP_WAIT_POLICY": "ACTIVE"}))
    assert (spin, policy, seen) == (None, "ACTIVE", "OMP_WAIT_POLICY=ACTIVE")


def test_torch_first_is_reported_as_too_late() -> None:
    _, _, seen = json.loads(run_python(PROBE.format(first="import torch; import radixlm; "),
                                       {}))
    assert seen.startswith("unknown: OpenMP loaded before radixlm"), seen


def proc_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in items}


def test_server_scheduler_gets_the_defaults(make_server, tiny_llama_dir,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # the server starts without them
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    srv = make_server(["--model-path", str(tiny_llama_dir), "--max-total-tokens", "2048"])
    info = requests.get(f"{srv.url}/get_server_info", timeout=30).json()
    assert info["omp_wait_policy"] == f"GOMP_SPINCOUNT={DEFAULT_SPINCOUNT}"
    assert 1 <= info["torch_threads"] <= max(cpu_threads.cpu_budget() - 1, 1)
    env = proc_environ(info["pids"]["scheduler"])
    assert env.get("GOMP_SPINCOUNT") == DEFAULT_SPINCOUNT
    assert "OMP_WAIT_POLICY" not in env


def test_server_cpu_threads_flag_is_kept(make_server, tiny_llama_dir) -> None:
    srv = make_server(["--model-path", str(tiny_llama_dir), "--max-total-tokens", "2048",
                       "--cpu-threads", "1"])
    info = requests.get(f"{srv.url}/get_server_info", timeout=30).json()
    assert info["torch_threads"] == 1 and info["cpu_threads"] == 1


def test_engine_sizes_from_the_budget_and_keeps_cpu_threads(make_engine,
                                                            tiny_llama_dir) -> None:
    before = torch.get_num_threads()
    try:
        eng = make_engine(model_path=str(tiny_llama_dir), cpu_threads=None)
        info = eng.get_server_info()
        assert 1 <= info["torch_threads"] <= cpu_threads.cpu_budget()
        assert torch.get_num_threads() == info["torch_threads"]
        fixed = make_engine(model_path=str(tiny_llama_dir), cpu_threads=1)
        assert fixed.get_server_info()["torch_threads"] == 1 == torch.get_num_threads()
        assert fixed.scheduler.threads.resize() is None  # --cpu-threads: never resized
    finally:
        torch.set_num_threads(before)
