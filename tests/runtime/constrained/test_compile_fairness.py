"""New grammars wait for the compile worker in turn by tenant: one tenant's burst of specs
(each of which may run to the compile limits) delays its own next spec, not another
tenant's. The order is fixed by the queue, not by how fast anything compiles: every compile
is slowed by the same injected delay."""

from __future__ import annotations

import threading

import pytest

from radixlm.runtime.constrained import GrammarCompiler, create_grammar_backend
from radixlm.runtime.constrained.compiler import FairQueue
from radixlm.runtime.tokenizer import load_tokenizer
from radixlm.tiny_model import default_tiny_model_path

VOCAB = 2000


def test_the_queue_takes_owners_in_turn() -> None:
    q = FairQueue()
    for job in ["a1", "a2", "a3"]:
        q.put("a", job)
    q.put("b", "b1")
    q.put(None, "n1")
    q.put("b", "b2")
    assert [q.take() for _ in range(len(q))] == ["a1", "b1", "n1", "a2", "b2", "a3"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(default_tiny_model_path("llama")))


def test_another_tenants_spec_is_not_queued_behind_a_burst(tokenizer) -> None:
    backend = create_grammar_backend("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(backend, timeout_s=60, compile_delay_s=0.05)
    done: list[str] = []
    lock = threading.Lock()

    def record(name: str):
        def callback(_fut) -> None:
            with lock:
                done.append(name)
        return callback

    try:
        futures = []
        for i in range(8):  # tenant a's burst of distinct specs
            futures.append(compiler.submit("regex", f"a{{{i + 1}}}x", owner="a"))
            futures[-1].add_done_callback(record(f"a{i}"))
        futures.append(compiler.submit("regex", "b+y", owner="b"))
        futures[-1].add_done_callback(record("b"))
        for fut in futures:
            fut.result(timeout=60)
    finally:
        compiler.shutdown()
    # the first of a's may be running and the second queued before b's arrives; then b's
    assert done.index("b") <= 2, done
