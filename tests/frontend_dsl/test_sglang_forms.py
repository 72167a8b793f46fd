"""SGLang's calling forms in radixlm's frontend, on the in-process Engine: role methods
(call and ``with`` block), ``forks[i] +=``, list ``+=`` on a fork, ``s.copy()``,
``text_async_iter(return_meta_data=True)``, ``separate_reasoning``, ``run_batch`` with
positional lists and ``generator_style``, ``use_thread=False``, ``global_config``."""

from __future__ import annotations

import asyncio

import pytest

import radixlm as sgl
from radixlm.frontend_dsl.reasoning import split_reasoning


@pytest.fixture(scope="module")
def engine(make_module_engine):
    return make_module_engine(max_total_tokens=16384)


@pytest.fixture
def backend(engine):
    return sgl.LocalBackend(engine)


class CannedBackend(sgl.LocalBackend):
    """Every gen returns ``reply`` (to test text handling independent of the model)."""

    def __init__(self, engine, reply: str):
        super().__init__(engine)
        self.reply = reply

    def generate(self, prompt, sampling_params, logprob_args):
        return self.reply, {"finish_reason": {"type": "stop"}}


def test_role_method_call_and_block_equal_role_exprs(backend):
    @sgl.function
    def methods(s):
        s.system("Be brief.")
        with s.user():
            s += "Hi"
        with s.assistant():
            s += sgl.gen("a", max_tokens=4)

    @sgl.function
    def exprs(s):
        s += sgl.system("Be brief.") + sgl.user("Hi") + sgl.assistant(sgl.gen("a", max_tokens=4))

    one = methods.run(backend=backend, temperature=0)
    two = exprs.run(backend=backend, temperature=0)
    assert one.text() == two.text() and one["a"] == two["a"]
    assert [m["role"] for m in one.messages()] == ["system", "user", "assistant"]
    assert one.messages() == two.messages()


def test_fork_item_iadd_list_iadd_and_copy(backend):
    @sgl.function
    def prog(s):
        s += "Colors:"
        forks = s.fork(2)
        forks += [" red", " blue"]
        for i in range(2):
            forks[i] += sgl.gen("more", max_tokens=3)
        forks.join()
        with s.copy() as c:
            c += " green" + sgl.gen("copied", max_tokens=3)

    @sgl.function
    def single(s, color):
        s += "Colors:" + color + sgl.gen("more", max_tokens=3)

    state = prog.run(backend=backend, temperature=0)
    assert state["more"] == [single.run(color=c, backend=backend, temperature=0)["more"]
                             for c in (" red", " blue")]
    assert state["copied"] == [single.run(color=" green", backend=backend, temperature=0)["more"]]
    assert state.text() == "Colors:"


def test_fork_group_rejects_a_wrong_list_and_replacement(backend):
    @sgl.function
    def prog(s, mode):
        forks = s.fork(2)
        if mode == "list":
            forks += ["only one"]
        else:
            forks[0] = forks[1]

    with pytest.raises(ValueError, match="list of 1 items; the fork has 2"):
        prog.run(mode="list", backend=backend)
    with pytest.raises(TypeError, match="cannot be replaced"):
        prog.run(mode="replace", backend=backend)


def test_text_async_iter_meta_data_carries_every_token(engine, backend):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=10)

    state = story.run(stream=True, backend=backend, temperature=0, return_logprob=True)

    async def collect():
        return [x async for x in state.text_async_iter("story", return_meta_data=True)]

    chunks = asyncio.run(collect())
    want = engine.generate("Once upon a time", {"max_new_tokens": 10, "temperature": 0})
    assert "".join(p for p, _ in chunks) == state["story"] == want["text"]
    assert [e[1] for _, m in chunks for e in m["output_token_logprobs"]] == want["output_ids"]
    assert state.get_meta_info("story")["output_token_logprobs"] == [
        e for _, m in chunks for e in m["output_token_logprobs"]
    ]
    assert state.get_meta_info("no_such_var") is None


@pytest.mark.parametrize(
    ("text", "model_type", "reasoning", "answer"),
    [
        ("<think>add them</think>42", "qwen3", "add them", "42"),
        ("just 42", "qwen3", "", "just 42"),
        ("add them</think>42", "deepseek-r1", "add them", "42"),
        ("<think>still thinking", "deepseek-r1", "still thinking", ""),
    ],
)
def test_split_reasoning(text, model_type, reasoning, answer):
    assert split_reasoning(text, model_type) == (reasoning, answer)


def test_separate_reasoning_in_a_program(engine):
    canned = CannedBackend(engine, "<think>two and two</think>four")

    @sgl.function
    def prog(s):
        s += sgl.user("2+2?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer"), model_type="qwen3"))

    state = prog.run(backend=canned)
    assert state["answer"] == "four"
    assert state["answer_reasoning_content"] == "two and two"
    assert state.messages()[-1] == {"role": "assistant", "content": "four"}
    assert "think" not in state.text()
    with pytest.raises(ValueError, match="unknown model type"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="nope")


def test_run_batch_positional_lists_and_generator_style(backend):
    @sgl.function
    def prog(s, word, suffix="!"):
        s += word + suffix + sgl.gen("x", max_tokens=3)

    by_dict = prog.run_batch([{"word": "a"}, {"word": "b", "suffix": "?"}], backend=backend,
                             temperature=0)
    by_list = prog.run_batch([["a"], ("b", "?")], backend=backend, temperature=0)
    gen = prog.run_batch([["a"], ["b", "?"]], backend=backend, temperature=0,
                         generator_style=True)
    assert not isinstance(gen, list)
    lazy = list(gen)
    assert [s["x"] for s in by_dict] == [s["x"] for s in by_list] == [s["x"] for s in lazy]
    with pytest.raises(TypeError, match="does not match prog"):
        prog.run_batch([["a", "b", "c"]], backend=backend)


def test_use_thread_false_runs_in_the_callers_thread(backend):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=3)

    inline = prog.run(backend=backend, temperature=0, use_thread=False)
    threaded = prog.run(backend=backend, temperature=0)
    assert inline["x"] == threaded["x"] and inline.text() == threaded.text()


def test_global_config_and_no_backend_forms(backend, capsys):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)

    saved = sgl.global_config.default_backend
    try:
        sgl.global_config.default_backend = None
        assert sgl.flush_cache() is False and sgl.get_server_info() is None
        sgl.global_config.default_backend = backend
        sgl.global_config.verbosity = 2
        state = prog.run(temperature=0)
        assert capsys.readouterr().out == state.text() + "\n"
    finally:
        sgl.global_config.verbosity = 0
        sgl.global_config.default_backend = saved


def test_append_none_and_images_are_refused(backend):
    @sgl.function
    def prog(s):
        s += None

    with pytest.raises(ValueError, match="append None"):
        prog.run(backend=backend)
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.image("cat.png")
