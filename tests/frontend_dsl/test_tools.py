"""Tools in programs on the in-process backend: ``function_tool`` schemas, forced calls
that validate (jsonschema), a full round trip whose prompt is transformers'
``apply_chat_template`` of the same messages, ``auto`` read by the parser, and every error.
With random weights the model never calls by itself, so calls are forced (``required``,
named); ``auto`` is checked on a reply that contains a call."""

from __future__ import annotations

from typing import Literal

import pytest

import radixlm as sgl
from radixlm.frontend_dsl.backends.base import Prompt
from radixlm.frontend_dsl.tool_schema import function_tool, parse_docstring
from tests.frontend_dsl.tool_programs import (
    QUESTION,
    SCHEMAS,
    TOOLS,
    check_calls,
    equivalent_messages,
    get_weather,
    round_trip,
)
from tests.runtime.entrypoints.function_call.tools_model import tools_model_dir


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir, tmp_path_factory):
    return tools_model_dir(tiny_qwen2_dir, tmp_path_factory.mktemp("dsl_tools") / "m")


@pytest.fixture(scope="module")
def engine(make_module_engine, model_dir):
    return make_module_engine(model_path=str(model_dir), max_total_tokens=4096,
                              random_seed=0)


class SpyBackend(sgl.LocalBackend):
    """Records each request's prompt and sampling params; ``reply`` replaces the model."""

    def __init__(self, engine, reply: str | None = None, **kw):
        super().__init__(engine, **kw)
        self.reply = reply
        self.requests: list[tuple[str, dict]] = []

    def generate(self, prompt: Prompt, sampling_params, logprob_args):
        self.requests.append((prompt.text, dict(sampling_params)))
        if self.reply is not None:
            return self.reply, {"finish_reason": {"type": "stop"}}
        return super().generate(prompt, sampling_params, logprob_args)


# --- function_tool --------------------------------------------------------------------------
def test_function_tool_schema_from_signature_and_docstring():
    tool = function_tool(get_weather)
    assert tool == {"type": "function", "function": {
        "name": "get_weather", "description": "The forecast for a city.",
        "parameters": {"type": "object", "required": ["city", "metric"],
                       "additionalProperties": False, "properties": {
                           "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"],
                                    "description": "where"},
                           "metric": {"type": "boolean", "description": "Celsius when true"},
                           "unit": {"anyOf": [{"type": "string", "enum": ["C", "F"]},
                                              {"type": "null"}],
                                    "description": "overrides metric", "default": None}}}}}


def test_function_tool_lists_and_errors():
    def f(xs: list[float], tag: Literal[1, "a"] = 1) -> None:
        """Sum.

        More text.
        """

    params = function_tool(f, name="summer")["function"]
    assert params["name"] == "summer" and params["description"] == "Sum. More text."
    assert params["parameters"]["properties"] == {
        "xs": {"type": "array", "items": {"type": "number"}},
        "tag": {"enum": [1, "a"], "default": 1}}

    def untyped(x):
        pass

    def bad(x: dict) -> None:
        pass

    def star(*args: int) -> None:
        pass

    with pytest.raises(TypeError, match="'x' needs a type annotation"):
        function_tool(untyped)
    with pytest.raises(TypeError, match="'x'.*not supported"):
        function_tool(bad)
    with pytest.raises(TypeError, match=r"\*args"):
        function_tool(star)
    assert parse_docstring("Do.\n\nArgs:\n    a (int): first\n        line two\n    b: x")[1] \
        == {"a": "first line two", "b": "x"}


# --- forced calls and the round trip ----------------------------------------------------------
@pytest.mark.parametrize("choice, allowed", [
    ("required", {"get_weather", "get_time"}),
    ("get_time", {"get_time"}),  # a bare name
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
])
def test_forced_call_validates(engine, choice, allowed):
    backend = SpyBackend(engine)
    state = round_trip.run(question=QUESTION, choice=choice, backend=backend)
    check_calls(state.tool_calls("call"), allowed)
    assert state["call"] == ""
    assert "json_schema" in backend.requests[0][1]  # held to the JSON array of calls
    assert state.tool_calls("answer") == []


def test_round_trip_prompt_is_the_templates(engine):
    backend = SpyBackend(engine)
    state = round_trip.run(question=QUESTION, choice="required", backend=backend)
    msgs = equivalent_messages(state)
    schemas = [function_tool(f) for f in TOOLS]
    expected = engine.tokenizer.apply_chat_template(msgs, tools=schemas, tokenize=False,
                                                    add_generation_prompt=True)
    second_prompt, second_params = backend.requests[1]
    assert second_prompt == expected
    assert "<tool_response>\nsunny in" in second_prompt or "noon" in second_prompt
    assert not any(k in second_params for k in ("json_schema", "structural_tag"))  # none
    final = msgs + [{"role": "assistant", "content": state["answer"]}]
    assert state.text() == engine.tokenizer.apply_chat_template(final, tools=schemas,
                                                                tokenize=False)
    assert state.messages()[1]["tool_calls"][0]["function"]["arguments"] == \
        state.tool_calls("call")[0].arguments_json


def test_parallel_false_is_one_call(engine):
    @sgl.function
    def one(s):
        s += sgl.user(QUESTION)
        s += sgl.assistant(sgl.gen("c", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=60, temperature=0))

    backend = SpyBackend(engine)
    state = one.run(backend=backend)
    assert len(state.tool_calls("c")) == 1
    assert '"maxItems": 1' in str(backend.requests[0][1]["json_schema"]).replace("'", '"')


# --- auto: the parser reads the reply ---------------------------------------------------------
def test_auto_reads_a_call_from_the_text(engine):
    reply = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}' \
            '\n</tool_call>'
    backend = SpyBackend(engine, reply=reply, tool_call_parser="qwen25")

    @sgl.function
    def auto(s):
        s += sgl.user("What time is it?")
        s += sgl.assistant(sgl.gen("c", tools=TOOLS, max_tokens=60))

    state = auto.run(backend=backend)
    assert state["c"] == "Let me look."
    [call] = state.tool_calls("c")
    assert (call.name, call.arguments) == ("get_time", {"zone": "UTC"})
    params = backend.requests[0][1]
    assert "structural_tag" in params and "json_schema" not in params
    assert state.messages()[-1]["tool_calls"][0]["function"]["name"] == "get_time"


def test_auto_without_a_parser_is_a_clear_error(engine):
    @sgl.function
    def auto(s):
        s += sgl.user("hi")
        s += sgl.assistant(sgl.gen("c", tools=TOOLS, max_tokens=4))

    with pytest.raises(ValueError, match="tool_call_parser"):
        auto.run(backend=sgl.LocalBackend(engine)).sync()


# --- errors -------------------------------------------------------------------------------
def test_tools_outside_an_assistant_turn_is_refused(engine):
    @sgl.function
    def plain(s):
        s += "Q: weather?\nA:" + sgl.gen("c", tools=TOOLS, tool_choice="required")

    with pytest.raises(ValueError, match="must come first inside assistant"):
        plain.run(backend=sgl.LocalBackend(engine)).sync()


def test_bad_tool_arguments_fail_at_gen():
    with pytest.raises(ValueError, match=r"tools\[0\]\.type must be 'function'"):
        sgl.gen("c", tools=[{"type": "web_search"}])
    with pytest.raises(ValueError, match="not among the request's tools"):
        sgl.gen("c", tools=TOOLS, tool_choice="get_stock")
    with pytest.raises(ValueError, match="needs tools"):
        sgl.gen("c", tool_choice="required")
    with pytest.raises(ValueError, match="not both"):
        sgl.gen("c", tools=TOOLS, regex="a+")
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        sgl.gen("c", tools=TOOLS, parallel_tool_calls="yes")
    with pytest.raises(ValueError, match="ToolCall or its id"):
        sgl.tool_result(None, "x")


def test_tool_result_needs_a_known_call(engine):
    @sgl.function
    def orphan(s):
        s += sgl.user("hi")
        s += sgl.tool_result("call_nope", {"a": 1})

    with pytest.raises(ValueError, match="no tool call with id 'call_nope'"):
        orphan.run(backend=sgl.LocalBackend(engine)).sync()


def test_schemas_are_the_functions():
    assert set(SCHEMAS) == {"get_weather", "get_time"}
