"""What a grammar costs per decode step is bounded (``--grammar-step-budget-ms``): a grammar
whose first steps cost more is refused when it first compiles (HTTP 400 naming the flag),
a running row whose grammar goes over at some later step ends alone with a 400 while its
batch-mates finish as they would have, and the text jumped over in one step is capped.

The costly grammars are real pathological inputs (nested counted repeats forcing hundreds
of thousands of characters, far over a 5 ms budget on any machine) or an injected delay;
nothing here compares a wall-clock time with a threshold of its own."""

from __future__ import annotations

import re
import threading

import pytest

from radixlm.runtime.constrained import create_grammar_backend
from radixlm.runtime.constrained.jump_forward import MAX_JUMP_FORWARD_CHARS, canonical_jump
from radixlm.runtime.constrained.step_budget import first_text_token, spin
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.tokenizer import load_tokenizer

FLAG = "--grammar-step-budget-ms"
PLAIN = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _costly(i: int) -> str:
    """A salted regex that forces n * n characters: the issue's (n = 2600, refused at once:
    no output is that long), or one that may also end after one more character (n = 600,
    refused by the budget: 360,000 characters forced once its first 'a' is sampled)."""
    return f"x{i}q(a{{2600}}){{2600}}" if i % 2 else f"x{i}q((a{{600}}){{600}}|b)"


def _outcomes(eng, prompts_params: list[tuple[str, dict]]) -> list[dict | Exception]:
    """Every request submitted at once, each on its own thread: its result or its error."""
    results: list[dict | Exception] = [RuntimeError("never ran")] * len(prompts_params)

    def run(i: int, prompt: str, params: dict) -> None:
        try:
            results[i] = eng.generate(prompt, params)
        except Exception as e:  # noqa: BLE001 - the outcome under test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, *pp)) for i, pp in enumerate(prompts_params)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_thirty_costly_regexes_are_refused_while_another_tenant_is_served(
        make_engine, tiny_llama_dir):
    eng = make_engine(model_path=str(tiny_llama_dir), grammar_step_budget_ms=5)
    solo = eng.generate("hello", PLAIN)
    before = eng.get_server_info()
    costly = [("x", {"max_new_tokens": 6, "regex": _costly(i)}) for i in range(30)]
    *refused, other = _outcomes(eng, [*costly, ("hello", PLAIN)])
    assert other["output_ids"] == solo["output_ids"], other
    for i, out in enumerate(refused):
        assert isinstance(out, ValueError), out
        if i % 2:
            assert "shortest match has 676000" in str(out), out
        else:
            assert FLAG in str(out) and "budget of 5 ms" in str(out), out
    after = eng.get_server_info()
    # refused at their first compile, in the compile worker: none ran in the scheduler
    assert after["jump_forward_tokens"] == before["jump_forward_tokens"]
    assert after["generation_tokens"] - before["generation_tokens"] == 6


class _SlowAfter:
    """A matcher whose jump-forward burns ``delay_s`` of CPU from its ``after``-th call on
    (the test hook for a grammar that grows costly at run time, past what the probe
    walked)."""

    def __init__(self, inner, after: int, delay_s: float) -> None:
        self.inner, self.after, self.delay_s, self.calls = inner, after, delay_s, 0

    def forced_string(self) -> str:
        self.calls += 1
        if self.calls >= self.after:
            spin(self.delay_s)
        return self.inner.forced_string()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_row_over_the_budget_at_run_time_ends_alone(make_engine, tiny_llama_dir,
                                                       monkeypatch):
    eng = make_engine(model_path=str(tiny_llama_dir), grammar_step_budget_ms=200)
    real = Scheduler.grammar_ready

    def grammar_ready(self, req):
        ready = real(self, req)
        if ready and req.grammar is not None and "slow" in (req.sampling_params.regex or ""):
            req.grammar = _SlowAfter(req.grammar, after=3, delay_s=0.5)
        return ready

    mates = [("Answer:", {"max_new_tokens": 12, "temperature": 0, "regex": r"[0-9]{2}-[a-z]+"}),
             ("Answer:", {"max_new_tokens": 12, "temperature": 0, "json_schema":
                          '{"type": "object", "properties": {"a": {"type": "integer"}}}'}),
             ("hello", PLAIN)]
    solos = [eng.generate(p, sp) for p, sp in mates]
    monkeypatch.setattr(Scheduler, "grammar_ready", grammar_ready)
    slow = ("Answer:", {"max_new_tokens": 12, "temperature": 0, "regex": "slow[a-z]{0,20}"})
    first, *others = _outcomes(eng, [slow, *mates])
    assert isinstance(first, ValueError) and FLAG in str(first), first
    assert "jump-forward" in str(first) and "200 ms" in str(first), first
    for out, solo in zip(others, solos):
        assert out["output_ids"] == solo["output_ids"], (out, solo)
    assert re.fullmatch(r"[0-9]{2}-[a-z]+", others[0]["text"]) or (
        others[0]["meta_info"]["finish_reason"]["type"] == "length")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


def test_one_step_jumps_over_at_most_the_cap(tokenizer):
    """(a{300}){300} forces 90,000 characters: one step appends at most the cap's worth."""
    backend = create_grammar_backend("xgrammar", tokenizer, 2000, [tokenizer.eos_token_id])
    matcher = backend.compile("regex", "x(a{300}){300}").new_matcher()
    (x,) = tokenizer.encode("x", add_special_tokens=False)
    assert matcher.accept_token(x)
    forced = matcher.forced_string()
    assert len(forced) == 90_000
    jump = canonical_jump(matcher, tokenizer, [x], forced)
    assert jump is not None and jump.ids
    # the step's own "x" is encoded again with the forced text: at most 1 + the cap
    assert len(tokenizer.decode(jump.ids)) <= MAX_JUMP_FORWARD_CHARS + 1
    assert len(matcher.forced_string()) >= len(forced) - MAX_JUMP_FORWARD_CHARS


def test_a_long_forced_string_is_jumped_over_in_capped_steps(make_engine, tiny_llama_dir):
    # no step budget: what is under test is the cap, whatever this machine's speed
    eng = make_engine(model_path=str(tiny_llama_dir), grammar_step_budget_ms=0)
    before = eng.get_server_info()
    out = eng.generate("x", {"max_new_tokens": 64, "regex": "x(a{100}){100}"})
    after = eng.get_server_info()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert set(out["text"][1:]) == {"a"}
    steps = after["forward_steps"] - before["forward_steps"]
    jumped = after["jump_forward_tokens"] - before["jump_forward_tokens"]
    assert 0 < jumped <= steps * MAX_JUMP_FORWARD_CHARS, (jumped, steps)


def test_first_text_token_skips_stop_tokens():
    import torch

    row = torch.zeros(4, dtype=torch.int32)
    row[1] = (1 << 3) | (1 << 5)
    assert first_text_token(row, []) == 35
    assert first_text_token(row, [35]) == 37
    assert first_text_token(row, [35, 37]) is None
    row[3] = -(1 << 31)  # bit 31: the sign bit of an int32 word
    assert first_text_token(row, [35, 37]) == 127
