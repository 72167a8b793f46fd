"""A server's scheduler starts its grammar compile worker before the model loads and is
ready only once the worker is (its start-up takes seconds of a core that the first requests
would otherwise share); an Engine's scheduler starts it on the first grammar."""

from __future__ import annotations

import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.constrained.compiler import GrammarCompiler
from radixlm.runtime.managers.scheduler import scheduler as scheduler_module
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.tokenizer import load_tokenizer


@pytest.fixture
def events(monkeypatch):
    """The order of the worker's start and the model's load."""
    seen: list[str] = []
    real_runner, real_warm_up = scheduler_module.ModelRunner, GrammarCompiler.warm_up

    def runner(*args, **kwargs):
        seen.append("model")
        return real_runner(*args, **kwargs)

    def warm_up(self, wait=False):
        seen.append("worker")
        real_warm_up(self, wait)

    monkeypatch.setattr(scheduler_module, "ModelRunner", runner)
    monkeypatch.setattr(GrammarCompiler, "warm_up", warm_up)
    return seen


def _scheduler(model_dir, **kwargs) -> Scheduler:
    args = ServerArgs(max_total_tokens=1024, cpu_threads=1, random_seed=0)
    return Scheduler(args, str(model_dir), load_tokenizer(str(model_dir)), **kwargs)


def test_a_servers_worker_starts_before_the_model_loads(tiny_llama_dir, events):
    sched = _scheduler(tiny_llama_dir, warm_up_grammar=True)
    try:
        assert events == ["worker", "model"]
        sched.grammar_compiler.wait_warm()
        worker = sched.grammar_compiler.worker
        # started and past its ready frame: a probe needs no start-up
        assert worker is not None and worker._proc is not None and worker._proc.poll() is None
        assert worker._base_rss > 0
        kind, spec = "regex", "[ab]{3}"
        assert sched.grammar_compiler.submit(kind, spec).result(timeout=60) is not None
        assert worker.kills == 0 and worker._proc.poll() is None  # the same child probed it
    finally:
        sched.grammar_compiler.shutdown()


def test_ready_means_json_object_is_compiled(tiny_llama_dir, events):
    """Once a server's scheduler is warm, OpenAI's json_object grammar has been probed in
    the worker and compiled here: the first such request is a cache hit, not a compile."""
    sched = _scheduler(tiny_llama_dir, warm_up_grammar=True)
    compiler = sched.grammar_compiler
    try:
        compiler.wait_warm()
        assert compiler.cache_misses == 1 and compiler.cache_hits == 0
        future = compiler.submit("json_schema", {"type": "object"})
        assert future.done() and future.exception() is None
        assert compiler.cache_hits == 1 and compiler.cache_misses == 1
        assert compiler.submit("json_schema", '{"type":"object"}') is future  # canonical
    finally:
        compiler.shutdown()


def test_an_engines_worker_waits_for_the_first_grammar(tiny_llama_dir, events):
    sched = _scheduler(tiny_llama_dir)
    try:
        assert events == ["model"]
        sched.grammar_compiler.wait_warm()  # nothing to wait for
        assert sched.grammar_compiler.worker._proc is None
    finally:
        sched.grammar_compiler.shutdown()
