"""Tool calling and reasoning through ``radixlm serve`` with the official openai client.

With random weights a model never picks a tool itself, so calls are forced (``required``,
a named function): the grammar makes the arguments valid, which jsonschema checks. One
module-scoped server on the tiny Qwen2 model with a tools-aware template (tools_model.py),
``--tool-call-parser qwen25`` and ``--reasoning-parser qwen3``.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.compat.agent_frameworks import run_client
from tests.runtime.entrypoints.function_call.tools_model import tools_model_dir

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir, tmp_path_factory):
    return tools_model_dir(tiny_qwen2_dir, tmp_path_factory.mktemp("tools_model") / "m")


@pytest.fixture(scope="module")
def server(module_server, model_dir):
    return module_server(["--model-path", str(model_dir), "--max-total-tokens", "8192",
                          "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3",
                          "--log-level", "warning", "--random-seed", "0"], "tools")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, allowed", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_calls_validate(client, choice, allowed):
    chat = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                          tool_choice=choice, max_tokens=200, seed=1)
    choice0 = chat.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    _check_calls(choice0.message.tool_calls, allowed)


def test_forced_call_beside_response_format(client):
    """A forced call wins over response_format (which is for text answers: the Agents SDK
    sends its output_type with every turn)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    chat = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                          tool_choice="required", response_format=fmt,
                                          max_tokens=200, seed=1)
    assert chat.choices[0].finish_reason == "tool_calls", chat.choices[0]
    _check_calls(chat.choices[0].message.tool_calls, set(SCHEMAS))
    text = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                          tool_choice="auto", response_format=fmt,
                                          max_tokens=32, seed=1)
    assert json.loads(text.choices[0].message.content)["ok"] in (True, False)


def test_each_choice_has_its_calls(client):
    chat = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                          tool_choice="required", n=2, max_tokens=200, seed=5)
    assert len(chat.choices) == 2
    for choice in chat.choices:
        _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_parallel_false_gives_one_call(client):
    chat = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=200, seed=2)
    assert len(chat.choices[0].message.tool_calls) == 1


def test_stream_reassembles_the_call(client):
    kwargs = dict(model="default", messages=USER, tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None and d.function.name, "id and name come first, once"
                call.update(id=d.id, name=d.function.name)
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_history_with_calls_renders(client, model_dir):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1, '
                                                          '"metric": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = client.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                          tool_choice="none", max_tokens=2)
    conv = [*USER, {**history[1], "content": "", "tool_calls": [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {
            "city": "Paris", "days": 1, "metric": True}}}]}, history[2]]
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert "<tool_response>\nsunny" in text and '"arguments": {"city": "Paris"' in text
    assert chat.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_auto_is_free_text_until_a_call(client):
    chat = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                          max_tokens=8, seed=3)
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
])
def test_bad_tool_requests_are_400(client, extra, param):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=USER, max_tokens=4,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_thinking_goes_to_reasoning_content(client):
    on = client.chat.completions.create(
        model="default", messages=USER, max_tokens=6, seed=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = on.choices[0].message
    assert msg.reasoning_content and not msg.content  # no </think> in 6 random tokens
    off = client.chat.completions.create(model="default", messages=USER, max_tokens=6, seed=4)
    assert off.choices[0].message.content and not off.choices[0].message.reasoning_content
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(
            model="default", messages=USER, max_tokens=6, seed=4, stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}}):
        for key in pieces:
            pieces[key] += (getattr(chunk.choices[0].delta, key, None) or "") \
                if chunk.choices else ""
    assert pieces == {"reasoning_content": msg.reasoning_content, "content": ""}
    # a forced call after thinking: the grammar waits for </think> (which random weights
    # do not write in 6 tokens: all of it is thinking, unconstrained)
    forced = client.chat.completions.create(
        model="default", messages=USER, max_tokens=6, seed=4, tools=TOOLS,
        tool_choice="required", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = forced.choices[0].message
    assert message.reasoning_content and not message.content and not message.tool_calls
    assert not message.reasoning_content.lstrip().startswith("[")  # not held to the array


FRAMEWORKS_SCRIPT = """
import asyncio, json, os
from typing import Literal
import pydantic

TOOLS = json.loads(os.environ["RADIXLM_TEST_TOOLS"])
USER = [{"role": "user", "content": "Weather in Paris?"}]
out = {}

class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = pydantic.Field(ge=1, le=7)
    metric: bool

from langchain_openai import ChatOpenAI
llm = ChatOpenAI(model="default", max_tokens=200, max_retries=0)
msg = llm.bind_tools(TOOLS, tool_choice="required").invoke("Weather in Paris?")
out["langchain_required"] = [[c["name"], c["args"]] for c in msg.tool_calls]
msg = llm.bind_tools(TOOLS, tool_choice="get_time").invoke("Time?")
out["langchain_named"] = [[c["name"], c["args"]] for c in msg.tool_calls]
got = llm.with_structured_output(Weather, method="function_calling").invoke("Weather?")
out["langchain_structured"] = got.model_dump() if isinstance(got, Weather) else repr(got)

import instructor
from openai import AsyncOpenAI, OpenAI
client = instructor.from_openai(OpenAI(max_retries=0), mode=instructor.Mode.TOOLS)
got = client.chat.completions.create(model="default", response_model=Weather,
                                     messages=USER, max_tokens=200, max_retries=0)
out["instructor"] = got.model_dump()

import litellm
resp = litellm.completion(model="openai/default", api_base=os.environ["OPENAI_BASE_URL"],
                          api_key="EMPTY", messages=USER, tools=TOOLS,
                          tool_choice="required", max_tokens=200)
out["litellm"] = [[c.function.name, json.loads(c.function.arguments)]
                  for c in resp.choices[0].message.tool_calls]
out["litellm_finish"] = resp.choices[0].finish_reason

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
called = []

@function_tool
def get_time(zone: Literal["CET", "UTC"]) -> str:
    "The time in a zone."
    called.append(zone)
    return "12:00"

agent = Agent(name="a", instructions="Use tools.", tools=[get_time],
              model=OpenAIChatCompletionsModel(model="default", openai_client=AsyncOpenAI()),
              model_settings=ModelSettings(tool_choice="required", max_tokens=100))
result = asyncio.run(Runner.run(agent, "What time is it?", max_turns=3))
out["agents_chat_called"] = called
print("RESULT " + json.dumps(out))
"""


def test_agent_frameworks_call_tools(server, monkeypatch):
    monkeypatch.setenv("RADIXLM_TEST_TOOLS", json.dumps(TOOLS))
    out = run_client(FRAMEWORKS_SCRIPT, server.url)
    for key, allowed in (("langchain_required", set(SCHEMAS)), ("langchain_named",
                                                                {"get_time"}),
                         ("litellm", set(SCHEMAS))):
        assert out[key], (key, out)
        for name, args in out[key]:
            assert name in allowed, (key, name)
            jsonschema.validate(args, SCHEMAS[name])
    assert out["litellm_finish"] == "tool_calls"
    for key in ("langchain_structured", "instructor"):
        assert isinstance(out[key], dict), (key, out[key])
        jsonschema.validate(out[key], WEATHER)
    assert out["agents_chat_called"] and out["agents_chat_called"][0] in ("CET", "UTC")


def test_generate_takes_sglangs_structural_tag(server):
    tag = {"structures": [{"begin": "<f>", "schema": TIME, "end": "</f>"}],
           "triggers": ["<f>"]}
    ok = httpx.post(server.url + "/generate", json={"text": "Hi", "sampling_params": {
        "max_new_tokens": 4, "structural_tag": json.dumps(tag)}}, timeout=60)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(server.url + "/generate", json={"text": "Hi", "sampling_params": {
        "max_new_tokens": 4, "structural_tag": {**tag, "triggers": ["<g>"]}}}, timeout=60)
    assert bad.status_code == 400 and "trigger" in bad.text, bad.text
