"""A step's jump-forward searches run off the scheduler's thread with a deadline: a search
that never returns ends its own row (400 naming the budget) and never holds the batch; the
rows after it skip their jump for the step; with every search thread held, a step takes no
jumps. Searches here block on events the test sets, so nothing depends on the machine's
speed."""

from __future__ import annotations

import re
import threading

from radixlm.runtime.constrained.jump_search import JumpSearch
from radixlm.runtime.managers.scheduler.scheduler import Scheduler

FLAG = "--grammar-step-budget-ms"


class _Fake:
    """A matcher whose forced text is ``text``, after ``gate`` is set (if given)."""

    def __init__(self, text: str, gate: threading.Event | None = None) -> None:
        self.text, self.gate, self.entered = text, gate, threading.Event()

    def forced_string(self) -> str:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        return self.text


def test_searches_in_time_give_every_row_its_text() -> None:
    searches = JumpSearch(deadline_s=30)
    found = searches.run([_Fake("a"), _Fake(""), _Fake("bc")])
    assert found is not None and found.texts == ["a", "", "bc"] and found.stuck is None
    searches.shutdown()


def test_a_search_past_the_deadline_is_stuck_and_the_rest_skip() -> None:
    gate = threading.Event()
    searches = JumpSearch(deadline_s=0.05, threads=2)
    stuck, after = _Fake("never", gate), _Fake("later")
    found = searches.run([_Fake("a"), stuck, after])
    assert found is not None and found.stuck == 1, found
    assert found.texts == ["a", None, None]
    gate.set()  # the search returns; the row after it was never searched
    assert not after.entered.wait(0.2)
    searches.shutdown()


def test_with_every_thread_held_a_step_takes_no_jumps() -> None:
    gate = threading.Event()
    searches = JumpSearch(deadline_s=0.05, threads=2)
    for _ in range(2):
        held = searches.run([_Fake("x", gate)])
        assert held is not None and held.stuck == 0
    assert searches.run([_Fake("y")]) is None  # no thread free: no search, no wait
    gate.set()
    searches.shutdown()


class _Blocked:
    """A matcher whose jump-forward search blocks until ``gate`` is set, from its
    ``after``-th call on (a search that would hold a step for as long as it likes)."""

    def __init__(self, inner, gate: threading.Event, after: int) -> None:
        self.inner, self.gate, self.after, self.calls = inner, gate, after, 0

    def forced_string(self) -> str:
        self.calls += 1
        if self.calls >= self.after:
            self.gate.wait()
        return self.inner.forced_string()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_row_whose_search_never_returns_ends_alone(make_engine, tiny_llama_dir,
                                                      monkeypatch) -> None:
    eng = make_engine(model_path=str(tiny_llama_dir), grammar_step_budget_ms=20)
    gate = threading.Event()
    real = Scheduler.grammar_ready

    def grammar_ready(self, req):
        ready = real(self, req)
        if ready and req.grammar is not None and "slow" in (req.sampling_params.regex or ""):
            req.grammar = _Blocked(req.grammar, gate, after=2)
        return ready

    monkeypatch.setattr(Scheduler, "grammar_ready", grammar_ready)
    plain = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    solo = eng.generate("hello", plain)
    results: dict[str, object] = {}

    def run(name: str, prompt: str, params: dict) -> None:
        try:
            results[name] = eng.generate(prompt, params)
        except Exception as e:  # noqa: BLE001 - the outcome under test
            results[name] = e

    jobs = {"slow": ("Answer:", {"max_new_tokens": 12, "temperature": 0,
                                 "regex": "slow[a-z]{0,20}"}),
            "mate": ("Answer:", {"max_new_tokens": 12, "temperature": 0,
                                 "regex": r"[0-9]{2}-[a-z]+"}),
            "plain": ("hello", plain)}
    threads = [threading.Thread(target=run, args=(k, *v)) for k, v in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        # every request answered while the blocked search still runs: no step waited on it
        assert not gate.is_set() and all(not t.is_alive() for t in threads), results
        slow = results["slow"]
        assert isinstance(slow, ValueError) and FLAG in str(slow), slow
        assert "jump-forward search ran past 200 ms" in str(slow), slow
        assert results["plain"]["output_ids"] == solo["output_ids"]
        mate = results["mate"]
        assert re.fullmatch(r"[0-9]{2}-[a-z]+", mate["text"]) or (
            mate["meta_info"]["finish_reason"]["type"] == "length"), mate
    finally:
        gate.set()
