"""Priority scheduling (SGLang's --enable-priority-scheduling and companion flags).

The scheduler is driven directly (``Scheduler.run_once``), so every request is queued
before the first step and the order in which requests finish is the order in which they
were admitted (one running request at a time). Outputs of preempted requests are checked
against the same requests run without preemption (greedy: the tokens must be equal).
"""

from __future__ import annotations

import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.managers.messages import GenerateReqInput, ReqOutput
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.managers.validation import (
    INT64_MAX,
    INT64_MIN,
    PriorityRefused,
    request_priority,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _req(rid: str, priority: int, max_new_tokens: int = 2, prompt: int = 0) -> GenerateReqInput:
    ids = [(prompt * 7 + i) % 1500 + 10 for i in range(12)]
    return GenerateReqInput(rid, ids, {**GREEDY, "max_new_tokens": max_new_tokens},
                            priority=priority)


def _run(sched: Scheduler, first: list, later: dict[int, list] | None = None
         ) -> tuple[list[str], dict[str, list[int]]]:
    """Feed ``first`` before step 0 and ``later[k]`` before step k; returns the finish
    order and each request's output tokens."""
    later = later or {}
    order: list[str] = []
    tokens: dict[str, list[int]] = {}

    def send(obj) -> None:
        if not isinstance(obj, list):
            return
        for out in obj:
            assert isinstance(out, ReqOutput)
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason.get("status_code") is None, out.finish_reason
                order.append(out.rid)

    step = 0
    sched.run_once(first, send)
    while not sched.is_idle() or any(k > step for k in later):
        step += 1
        sched.run_once(later.get(step, []), send)
    return order, tokens


def _scheduler(make_engine, **flags) -> Scheduler:
    return make_engine(max_running_requests=1, schedule_policy="fcfs", **flags).scheduler


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "lof"])
def test_higher_values_run_first(make_engine, policy):
    sched = make_engine(max_running_requests=1, schedule_policy=policy,
                        enable_priority_scheduling=True).scheduler
    reqs = [_req("low", 1, prompt=1), _req("mid", 5, prompt=2), _req("high", 9, prompt=3),
            _req("mid2", 5, prompt=4)]
    order, _ = _run(sched, reqs)
    assert order[0] == "high" and order[-1] == "low"
    assert set(order[1:3]) == {"mid", "mid2"}
    if policy == "fcfs":  # equal priorities keep their arrival order
        assert order == ["high", "mid", "mid2", "low"]


def test_low_priority_values_first(make_engine):
    sched = _scheduler(make_engine, enable_priority_scheduling=True,
                       schedule_low_priority_values_first=True)
    order, _ = _run(sched, [_req("a", 3), _req("b", -2), _req("c", 0)])
    assert order == ["b", "c", "a"]


def test_low_priority_waits_behind_high_ones(make_engine):
    """A low-priority request queued first still runs after every high one."""
    sched = _scheduler(make_engine, enable_priority_scheduling=True)
    reqs = [_req("low", 0, prompt=9)] + [_req(f"high{i}", 5, prompt=i) for i in range(3)]
    order, _ = _run(sched, reqs)
    assert order == ["high0", "high1", "high2", "low"]


def test_without_the_flag_priority_is_ignored(make_engine):
    sched = _scheduler(make_engine)
    order, _ = _run(sched, [_req("a", 0), _req("b", 100), _req("c", 50)])
    assert order == ["a", "b", "c"]


def test_preemption_by_a_much_more_urgent_request(make_engine):
    """``high`` arrives while ``low`` decodes: low is preempted (its KV kept in the tree),
    high finishes first, and low's output equals its output when nothing preempts it."""
    alone = _scheduler(make_engine)
    _, ref = _run(alone, [_req("low", 0, max_new_tokens=40, prompt=1),
                          _req("high", 50, max_new_tokens=3, prompt=2)])
    sched = _scheduler(make_engine, enable_priority_scheduling=True)
    order, tokens = _run(sched, [_req("low", 0, max_new_tokens=40, prompt=1)],
                         {5: [_req("high", 50, max_new_tokens=3, prompt=2)]})
    assert order == ["high", "low"]
    assert sched.stats["num_priority_preemptions"] == 1
    assert tokens == ref


@pytest.mark.parametrize("flags", [
    {"priority_scheduling_preemption_threshold": 50},  # a difference of 50 is not > 50
    {"disable_priority_preemption": True},
])
def test_no_preemption_below_threshold_or_when_disabled(make_engine, flags):
    sched = _scheduler(make_engine, enable_priority_scheduling=True, **flags)
    order, _ = _run(sched, [_req("low", 0, max_new_tokens=40, prompt=1)],
                    {5: [_req("high", 50, max_new_tokens=3, prompt=2)]})
    assert order == ["low", "high"]
    assert sched.stats["num_priority_preemptions"] == 0


def test_request_priority_rules():
    off = ServerArgs()
    assert request_priority(None, off) == 0 and request_priority(7, off) == 0
    refuse = ServerArgs(abort_on_priority_when_disabled=True)
    assert request_priority(None, refuse) == 0
    with pytest.raises(PriorityRefused, match="priority is disabled"):
        request_priority(7, refuse)
    on = ServerArgs(enable_priority_scheduling=True)
    assert request_priority(7, on) == 7 and request_priority(None, on) == INT64_MIN
    low_first = ServerArgs(enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert request_priority(None, low_first) == INT64_MAX
    default = ServerArgs(enable_priority_scheduling=True, default_priority_value=3)
    assert request_priority(None, default) == 3
    for bad in (1 << 63, True, 1.5, "1"):
        with pytest.raises(ValueError, match="signed 64-bit"):
            request_priority(bad, on)


def test_engine_generate_priority(make_engine):
    eng = make_engine(abort_on_priority_when_disabled=True)
    out = eng.generate("hello", {"max_new_tokens": 2}, priority=None)
    assert out["meta_info"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="priority is disabled"):
        eng.generate("hello", {"max_new_tokens": 2}, priority=3)
    eng2 = make_engine(enable_priority_scheduling=True)
    sp = {"max_new_tokens": 4, "temperature": 0.0}
    assert eng2.generate("hello", sp, priority=3)["text"] == eng.generate("hello", sp)["text"]
