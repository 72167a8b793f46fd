"""--max-queued-requests with priority scheduling (SGLang's rule, enforced by the
scheduler): a full queue drops its least urgent request (the newest among equals) for a
strictly more urgent one, and otherwise refuses the newcomer; both get a 503. Without
priority scheduling the front end enforces the limit (test_server_errors.py)."""

from __future__ import annotations

from radixlm.runtime.managers.messages import GenerateReqInput, ReqOutput
from radixlm.runtime.managers.scheduler.scheduler import Scheduler

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 2}


def _req(rid: str, priority: int) -> GenerateReqInput:
    ids = [(len(rid) * 31 + priority * 7 + i) % 1500 + 10 for i in range(12)]
    return GenerateReqInput(rid, ids, dict(GREEDY), priority=priority)


def _drive(sched: Scheduler, batches: list[list[GenerateReqInput]]) -> dict[str, dict]:
    """Each batch handed to one scheduler turn, then run to idle; each rid's finish
    reason ({} when it finished normally)."""
    done: dict[str, dict] = {}

    def send(obj) -> None:
        for out in obj if isinstance(obj, list) else []:
            assert isinstance(out, ReqOutput)
            if out.finished:
                assert out.rid not in done, f"{out.rid} finished twice"
                reason = out.finish_reason or {}
                done[out.rid] = reason if reason.get("status_code") else {}

    for batch in batches:
        sched.run_once(batch, send)
    while not sched.is_idle():
        sched.run_once([], send)
    return done


def _scheduler(make_engine, **flags) -> Scheduler:
    return make_engine(max_running_requests=1, schedule_policy="fcfs", max_queued_requests=2,
                       enable_priority_scheduling=True, **flags).scheduler


def _dropped(reason: dict) -> bool:
    return reason.get("status_code") == 503 and "more urgent" in reason["message"]


def _refused(reason: dict) -> bool:
    return (reason.get("status_code") == 503 and "queue is full" in reason["message"]
            and "--max-queued-requests" in reason["message"])


def test_full_queue_drops_the_least_urgent_for_a_more_urgent_request(make_engine):
    sched = _scheduler(make_engine)
    # one turn: all five reach the queue before any step; the queue holds 2
    done = _drive(sched, [[_req("a", 1), _req("b", 5), _req("c", 3), _req("d", 1),
                           _req("e", 3)]])
    assert _dropped(done["a"])   # c (3) outranks a (1), the least urgent queued
    assert _refused(done["d"])   # d (1) outranks nobody in {b 5, c 3}
    assert _refused(done["e"])   # e (3) only ties c: not strictly more urgent
    assert done["b"] == {} and done["c"] == {}
    assert sched.stats.get("num_priority_preemptions", 0) == 0


def test_among_equals_the_newest_is_dropped(make_engine):
    sched = _scheduler(make_engine)
    done = _drive(sched, [[_req("old", 1), _req("new", 1), _req("urgent", 9)]])
    assert _dropped(done["new"])
    assert done["old"] == {} and done["urgent"] == {}


def test_low_priority_values_first_flips_who_is_dropped(make_engine):
    sched = _scheduler(make_engine, schedule_low_priority_values_first=True)
    done = _drive(sched, [[_req("x", 5), _req("y", 0), _req("z", -3), _req("w", 7)]])
    assert _dropped(done["x"])  # z (-3) outranks x (5), the least urgent
    assert _refused(done["w"])
    assert done["y"] == {} and done["z"] == {}


def test_only_queued_requests_count(make_engine):
    # the running one is not in the queue: after a step admits it, two more fit
    sched = _scheduler(make_engine)
    done = _drive(sched, [[_req("first", 0)], [_req("q1", 0), _req("q2", 0)]])
    assert done == {"first": {}, "q1": {}, "q2": {}}


def test_without_priority_scheduling_the_scheduler_does_not_limit(make_engine):
    sched = make_engine(max_running_requests=1, max_queued_requests=1).scheduler
    done = _drive(sched, [[_req(f"r{i}", 0) for i in range(4)]])
    assert done == {f"r{i}": {} for i in range(4)}
