"""DSL details on the in-process backend: select's three rules against an independent
computation, sampling arguments reaching the runtime, tracing, and every error path."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import radixlm as sgl
from radixlm.frontend_dsl import program
from radixlm.frontend_dsl.backends.base import BackendError, Prompt
from radixlm.frontend_dsl.dtype_regex import dtype_to_regex


@pytest.fixture(scope="module")
def engine(make_module_engine):
    return make_module_engine(model_path=None, max_total_tokens=16384)


class SpyBackend(sgl.LocalBackend):
    """Records the sampling_params of every gen."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls: list[dict] = []

    def generate(self, prompt, sampling_params, logprob_args):
        self.calls.append(dict(sampling_params))
        return super().generate(prompt, sampling_params, logprob_args)


class FailingBackend(sgl.LocalBackend):
    def generate(self, prompt, sampling_params, logprob_args):
        raise BackendError("the server went away")


@pytest.fixture
def backend(engine):
    return sgl.LocalBackend(engine)


def _dsl_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("radixlm-dsl")]


# --- select --------------------------------------------------------------------------------
CHOICES = [" red", " green", " blue", " dark purple"]
PREFIX = "Q: What colour is the sky at night?\nA:"


def _choice_logprobs(engine, prefix, choices):
    tok = engine.tokenizer
    n = len(tok.encode(prefix, add_special_tokens=False))
    cond, uncond = [], []
    for c in choices:
        out = engine.generate(
            prefix + c, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=n
        )
        ents = out["meta_info"]["input_token_logprobs"]
        cond.append([e[0] for e in ents])
        ids = [e[1] for e in ents]
        u = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
        uncond.append(
            [0.0 if e[0] is None else e[0] for e in u["meta_info"]["input_token_logprobs"]]
        )
    return cond, uncond


def _first_argmax(scores):
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def _greedy(rows):
    width = max(len(r) for r in rows)
    mat = [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]
    alive = list(range(len(rows)))
    for j in range(width):
        top = max(mat[i][j] for i in alive)
        alive = [i for i in alive if mat[i][j] == top]
        if len(alive) == 1:
            break
    return alive[0]


@pytest.mark.parametrize(
    "rule",
    ["token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"],
)
def test_select_rules_match_independent_computation(engine, backend, rule):
    @sgl.function
    def pick(s):
        s += PREFIX + sgl.select("c", choices=CHOICES, choices_method=getattr(sgl, rule))

    cond, uncond = _choice_logprobs(engine, PREFIX, CHOICES)
    if rule == "token_length_normalized":
        best = _first_argmax([sum(r) / len(r) for r in cond])
    elif rule == "greedy_token_selection":
        best = _greedy(cond)
    else:
        best = _first_argmax(
            [sum(c - u for c, u in zip(cr, ur)) / len(cr) for cr, ur in zip(cond, uncond)]
        )
    state = pick.run(backend=backend)
    assert state["c"] == CHOICES[best]
    meta = state.get_meta_info("c")
    got = [sum(e[0] for e in ents) / len(ents) for ents in meta["input_token_logprobs"]]
    assert got == pytest.approx([sum(r) / len(r) for r in cond], abs=1e-4)


def test_select_in_assistant_role_and_gen_choices(backend):
    @sgl.function
    def route(s):
        s += sgl.user("Route this ticket.")
        s += sgl.assistant(sgl.gen("team", choices=["billing", "shipping"]))

    state = route.run(backend=backend)
    assert state["team"] in ("billing", "shipping")
    assert state.messages()[-1] == {"role": "assistant", "content": state["team"]}


def test_select_rejects_bad_choices():
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="non-empty strings"):
        sgl.select("x", choices=["a", ""])


# --- sampling arguments -----------------------------------------------------------------------
def test_gen_arguments_defaults_and_template_stops(engine):
    """As SGLang: every gen stops at the chat template's stop strings (any role), and
    int/float gens also at a space or newline."""
    spy = SpyBackend(engine)

    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("a", max_tokens=3, top_k=5, min_p=0.1, stop="\n")
        s += sgl.assistant(sgl.gen("b", frequency_penalty=0.5, ignore_eos=True))
        s += "n=" + sgl.gen_int("n", max_tokens=4) + sgl.gen_string("w", max_tokens=6)
        s += sgl.gen("j", max_tokens=4, json_schema={"type": "object"})

    prog.run(backend=spy, max_new_tokens=5, temperature=0.0, top_p=0.9)
    a, b, n, w, j = spy.calls
    assert a["max_new_tokens"] == 3 and a["top_k"] == 5 and a["min_p"] == 0.1
    assert a["stop"] == ["\n", "<|im_end|>"] and a["temperature"] == 0.0 and a["top_p"] == 0.9
    assert b["max_new_tokens"] == 5 and b["ignore_eos"] is True
    assert b["frequency_penalty"] == 0.5 and b["stop"] == ["<|im_end|>"]
    assert n["regex"] == dtype_to_regex(int) and w["regex"] == dtype_to_regex(str)
    assert n["stop"] == ["<|im_end|>", " ", "\n"] and w["stop"] == ["<|im_end|>"]
    assert j["json_schema"] == {"type": "object"}


def test_gen_with_an_ebnf_grammar(backend):
    """SGLang's ebnf sampling parameter through the DSL: the output is in the language."""

    @sgl.function
    def prog(s):
        s += "Verdict: " + sgl.gen("v", max_tokens=8, temperature=1.0,
                                   ebnf='root ::= ("yes" | "no") "!"?')

    for _ in range(3):
        state = prog.run(backend=backend)
        assert state["v"] in ("yes", "no", "yes!", "no!"), state["v"]


def test_gen_rejects_conflicting_constraints():
    with pytest.warns(UserWarning, match="only dtype is used"):
        assert sgl.gen("x", regex="a+", dtype=int).args.regex == dtype_to_regex(int)
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", json_schema="{}", dtype=int)
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", regex="a+", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="unsupported dtype"):
        sgl.gen("x", dtype=list)


# --- state API ---------------------------------------------------------------------------------
def test_var_scope_bind_and_variables(backend):
    @sgl.function
    def prog(s, topic, style):
        with s.var_scope("intro"):
            s += f"A {style} note on " + topic + ":"
            s += sgl.gen("body", max_tokens=4)
        s += sgl.user_begin() + "more" + sgl.user_end()
        s["extra"] = 42

    bound = prog.bind(style="short")
    state = bound.run(topic="tries", backend=backend, temperature=0)
    assert state["intro"] == "A short note on tries:" + state["body"]
    assert state["extra"] == 42 and "body" in state
    assert state.messages() == [{"role": "user", "content": "more"}]
    assert bound.trace(backend=backend) == "A short note on "
    with pytest.raises(TypeError, match="no argument"):
        prog.bind(colour="red")
    with pytest.raises(KeyError, match="missing"):
        state["missing"]


def test_text_async_iter(backend):
    @sgl.function
    def prog(s):
        s += "Stream:" + sgl.gen("x", max_tokens=12, ignore_eos=True)

    async def collect(state):
        return [p async for p in state.text_async_iter()]

    state = prog.run(backend=backend, stream=True, temperature=0)
    pieces = asyncio.run(collect(state))
    assert "".join(pieces) == state.text() and len(pieces) > 2


def test_run_batch_caches_traced_prefix_once(engine, backend):
    @sgl.function
    def fewshot(s, q):
        s += "Example: two plus two is four. " * 20
        s += "Q: " + q + " A:" + sgl.gen("a", max_tokens=2)

    prefix = fewshot.trace(backend=backend)
    assert prefix == "Example: two plus two is four. " * 20 + "Q: "
    engine.flush_cache()
    states = fewshot.run_batch([{"q": f"q{i}"} for i in range(8)], backend=backend, temperature=0)
    n_prefix = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
    assert all(s.get_meta_info("a")["cached_tokens"] >= n_prefix - 1 for s in states)


def test_fork_concate_and_append(backend):
    @sgl.function
    def prog(s):
        s += "Start."
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" [{i}]"
        forks.join("concate_and_append")
        s += " End."

    assert prog.run(backend=backend).text() == "Start. [0] [1] End."


# --- errors ------------------------------------------------------------------------------------
def test_exception_in_program_is_raised_and_kept(backend):
    @sgl.function
    def prog(s, fail):
        s += "Hi" + sgl.gen("x", max_tokens=2)
        if fail:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prog.run(fail=True, backend=backend)
    states = prog.run_batch([{"fail": False}, {"fail": True}], backend=backend, raise_errors=False)
    assert states[0].error() is None and isinstance(states[1].error(), RuntimeError)
    with pytest.raises(sgl.ProgramBatchError, match="1 of 2") as info:
        prog.run_batch([{"fail": False}, {"fail": True}], backend=backend)
    assert len(info.value.states) == 2
    streamed = prog.run(fail=True, backend=backend, stream=True)
    with pytest.raises(RuntimeError, match="boom"):
        list(streamed.text_iter())
    assert isinstance(streamed.error(), RuntimeError)
    _wait_no_threads()


def test_failed_backend_call_stops_the_program(engine):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)
        s += "After:" + s["x"]  # reading the failed variable raises in the program

    with pytest.raises(BackendError, match="went away"):
        prog.run(backend=FailingBackend(engine))
    with pytest.raises(ValueError, match="temperature"):
        prog.run(backend=sgl.LocalBackend(engine), temperature=-1.0)
    _wait_no_threads()


def test_timeout_aborts_and_raises(engine, backend, monkeypatch):
    # every scheduler step takes at least 5 ms, so the 3000 tokens (or as many as the
    # context holds) cannot finish within the timeout, however fast the machine
    step = engine.scheduler.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine.scheduler, "step", slow_step)

    @sgl.function
    def slow(s):
        s += "Go:" + sgl.gen("x", max_tokens=3000, ignore_eos=True)

    for stream in (False, True):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            state = slow.run(backend=backend, timeout=0.3, stream=stream)
            for _ in state.text_iter():
                time.sleep(0.02)  # a reader slower than the stream: new text at every wait
        assert time.monotonic() - t0 < 5
        engine.wait_idle(timeout=10)  # the request was aborted, not left running
    _wait_no_threads()


def test_role_errors(backend):
    @sgl.function
    def nested(s):
        s += sgl.user_begin() + sgl.assistant_begin()

    with pytest.raises(ValueError, match="inside user"):
        nested.run(backend=backend)

    @sgl.function
    def unmatched(s):
        s += sgl.assistant_end()

    with pytest.raises(ValueError, match="without a matching"):
        unmatched.run(backend=backend)


def test_no_backend_and_bad_backend():
    @sgl.function
    def prog(s):
        s += "x"

    previous = sgl.get_default_backend()
    try:
        program.global_config.default_backend = None
        with pytest.raises(RuntimeError, match="set_default_backend"):
            prog.run()
    finally:
        program.global_config.default_backend = previous
    with pytest.raises(TypeError, match="not a backend"):
        sgl.set_default_backend(object())


def test_engine_is_a_backend(engine):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)

    previous = sgl.get_default_backend()
    sgl.set_default_backend(engine)
    try:
        assert isinstance(prog.run(temperature=0)["x"], str)
        assert sgl.get_server_info()["cache_hit_rate"] >= 0
        assert sgl.flush_cache()
    finally:
        program.global_config.default_backend = previous


def test_cache_prefix_prompt(engine, backend):
    backend.cache_prefix(Prompt("A prefix that is cached once. " * 5))
    out = engine.generate("A prefix that is cached once. " * 5 + "More", {"max_new_tokens": 0})
    assert out["meta_info"]["cached_tokens"] > 0


def _wait_no_threads(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _dsl_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _dsl_threads(), _dsl_threads()
