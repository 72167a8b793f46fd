"""A request the front end should have refused never takes a child process down: the
scheduler refuses it alone (a 400 output, no KV taken) and the detokenizer fails only the
request whose text it cannot make. /health reads the scheduler's heartbeat."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.native_api import NativeRoutes
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.detokenizer import DetokenizerManager, make_register
from radixlm.runtime.managers.messages import BatchOutput, GenerateReqInput, RegisterReqs, ReqOutput
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.tokenizer import load_tokenizer

BAD_PARAMS = [
    {"seed": "abc", "temperature": 1.0},
    {"stop": [1]},
    {"stop": [None]},
    {"stop": 5},
    {"logit_bias": []},
    {"logit_bias": {"1": None}},
    {"logit_bias": {"1": float("nan")}},
    {"temperature": float("nan")},
    {"max_new_tokens": True},
    {"n": 10**9},
    {"no_such_param": 1},
    {"json_schema": {"type": "object", "properties": [1]}},
    {"regex": "("},
]


@pytest.fixture(scope="module")
def scheduler(tiny_llama_dir):
    args = ServerArgs(max_total_tokens=2048, cpu_threads=1, random_seed=0)
    sched = Scheduler(args, str(tiny_llama_dir), load_tokenizer(str(tiny_llama_dir)))
    sched.grammar_compiler.warm_up(wait=True)  # as a server's scheduler: the grammar
    yield sched  # requests below get a bounded number of steps, not the worker's start-up
    sched.grammar_compiler.shutdown()


def _run_until_finished(sched: Scheduler, msgs: list, rids: set[str]) -> dict[str, list]:
    outs: dict[str, list] = {}

    def send(obj):
        for out in obj if isinstance(obj, list) else []:
            outs.setdefault(out.rid, []).append(out)

    sched.run_once(msgs, send)
    for _ in range(500):
        if all(any(o.finished for o in outs.get(r, [])) for r in rids):
            break
        sched.run_once([], send)
    return outs


def test_scheduler_refuses_bad_requests_alone(scheduler):
    good = GenerateReqInput("good", [5, 6, 7], {"max_new_tokens": 6, "ignore_eos": True,
                                                "temperature": 0})
    bad = [GenerateReqInput(f"bad{i}", [5, 6], sp) for i, sp in enumerate(BAD_PARAMS)]
    bad += [GenerateReqInput("ids-none", [5, None], {}),  # type: ignore[list-item]
            GenerateReqInput("ids-bool", [True, False], {}),
            GenerateReqInput("ids-big", [2**70], {}),
            GenerateReqInput("top-bool", [5], {}, True, -1, True)]  # type: ignore[arg-type]
    outs = _run_until_finished(scheduler, [*bad, good], {m.rid for m in bad} | {"good"})
    for msg in bad:
        (out,) = outs[msg.rid]
        assert out.finish_reason["status_code"] == 400, (msg, out)
        assert out.completion_tokens == 0
    assert len(outs["good"][-1].new_token_ids) + sum(
        len(o.new_token_ids) for o in outs["good"][:-1]) == 6
    assert scheduler.is_idle()
    scheduler.check_idle_invariants()


class _Tokenizer:
    """Decodes like the real one, but cannot decode token 7."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode(self, ids, **kwargs):
        if 7 in ids:
            raise RuntimeError("cannot decode 7")
        return self.real.decode(ids, **kwargs)

    def convert_ids_to_tokens(self, ids, **kwargs):
        if 7 in (ids if isinstance(ids, list) else [ids]):
            raise RuntimeError("cannot decode 7")
        return self.real.convert_ids_to_tokens(ids, **kwargs)


def test_detokenizer_fails_only_the_request_it_cannot_decode(tiny_llama_dir):
    manager = DetokenizerManager(_Tokenizer(load_tokenizer(str(tiny_llama_dir))))
    regs = [make_register(rid, SamplingParams(), False) for rid in ("ok", "broken")]
    assert manager.handle(RegisterReqs(regs)) is None
    outs = [ReqOutput("ok", [40, 41], 3, 0, 2), ReqOutput("broken", [7], 3, 0, 1)]
    batch = manager.handle(BatchOutput(outs))
    ok, broken = batch.outputs
    assert ok.finish_reason is None and ok.new_token_ids == [40, 41]
    assert broken.finish_reason["status_code"] == 500
    assert "detokenization failed" in broken.finish_reason["message"]
    assert "broken" not in manager.reqs and "ok" in manager.reqs
    (later,) = manager.handle(BatchOutput([ReqOutput("ok", [42], 3, 0, 3, {"type": "length"})])
                              ).outputs
    assert later.finished and later.final_text is not None


@pytest.mark.parametrize("unhealthy,draining,age,status", [
    (None, False, 0.5, 200),
    (None, False, 31.0, 503),  # the scheduler's loop has not turned for over the timeout
    ("stuck", False, 0.5, 503),
    (None, True, 0.5, 503),
])
def test_health_reflects_the_scheduler_heartbeat(unhealthy, draining, age, status):
    routes = NativeRoutes.__new__(NativeRoutes)
    routes.tm = SimpleNamespace(unhealthy=unhealthy, draining=draining)
    routes.args = ServerArgs(watchdog_timeout=30.0)
    routes.heartbeat_age = lambda: age
    resp = asyncio.run(routes.health())
    assert resp.status_code == status
    if status == 503:
        assert json.loads(resp.body)["error"]["type"] == "service_unavailable"
