"""The agent frameworks against radixlm's Responses API (``/v1/responses``): the Agents SDK's
default model class (``OpenAIResponsesModel``) completes a run, and a function-tool round
trip (the model calls the tool, the SDK runs it and sends its output back); its thinking
with ``--reasoning-parser`` (a ``reasoning`` item, reasoning events and tokens, switched by
``chat_template_kwargs``); LiteLLM's ``litellm.responses``. Each client runs in the
frameworks' own venv (``agent_frameworks``). The model: the tiny Qwen2 with a template that
renders tools and opens ``<think>`` when ``enable_thinking`` is set (``tools_model.py``)."""

from __future__ import annotations

import base64
import json

import openai
import pytest

from tests.compat.agent_frameworks import run_client
from tests.runtime.entrypoints.function_call.tools_model import tools_model_dir

# the tool round trip's turn after the call is tool_choice 'auto': it needs a parser
FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0",
         "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]

AGENT_RUN = """
import asyncio, json, os
from typing import Literal
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
                    set_default_openai_client, set_tracing_disabled)

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"],
                                      api_key="EMPTY", max_retries=0))
set_default_openai_api("responses")
calls = []

class Flag(BaseModel):  # a structured final output: constrained, so the answer ends
    ok: bool
    n: int = Field(ge=0, le=9)

@function_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:  # an enum: random weights end it
    '''The weather in a city.'''
    calls.append(city)
    return f"sunny in {city}"

async def main():
    plain = Agent(name="plain", instructions="Be brief.", model="default", output_type=Flag,
                  model_settings=ModelSettings(max_tokens=64, temperature=0))
    out = await Runner.run(plain, "Say hello", max_turns=1)
    result = {"final": out.final_output.model_dump(),
              "raw": [r.response_id for r in out.raw_responses]}
    if TOOLS:
        agent = Agent(name="weather", instructions="Use the tool.", model="default",
                      tools=[get_weather], output_type=Flag, model_settings=ModelSettings(
                          max_tokens=64, temperature=0, tool_choice="get_weather"))
        out = await Runner.run(agent, "Weather in Paris?", max_turns=3)
        items = [type(i).__name__ for i in out.new_items]
        result.update(calls=calls, items=items, tool_final=out.final_output.model_dump())
    print("RESULT " + json.dumps(result))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def server(module_server, tiny_qwen2_dir, tmp_path_factory):
    model = tools_model_dir(tiny_qwen2_dir, tmp_path_factory.mktemp("thinking_model") / "m")
    return module_server(["--model-path", str(model), *FLAGS])


def test_agents_sdk_default_model_runs(server):
    got = run_client("TOOLS = False\n" + AGENT_RUN, server.url)
    assert isinstance(got["final"]["ok"], bool) and 0 <= got["final"]["n"] <= 9
    assert len(got["raw"]) == 1 and got["raw"][0].startswith("resp_")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stored = client.responses.retrieve(got["raw"][0])
    assert stored.instructions == "Be brief." and stored.status == "completed"
    assert json.loads(stored.output_text) == got["final"]
    assert stored.text.format.type == "json_schema"


def test_agents_sdk_tool_round_trip(server):
    got = run_client("TOOLS = True\n" + AGENT_RUN, server.url)
    assert got["calls"], got  # the SDK ran the tool with the model's arguments
    assert all(city in ("Paris", "Rome") for city in got["calls"])
    assert got["items"][:2] == ["ToolCallItem", "ToolCallOutputItem"], got
    assert 0 <= got["tool_final"]["n"] <= 9


def test_litellm_responses(server):
    got = run_client("""
        import json, os, litellm
        resp = litellm.responses(model="openai/default", input="Say hello",
                                 api_base=os.environ["OPENAI_BASE_URL"], api_key="EMPTY",
                                 max_output_tokens=16, temperature=0)
        print("RESULT " + json.dumps({"id": resp.id, "usage": resp.usage.output_tokens,
                                      "text": resp.output[0].content[0].text}))
    """, server.url)
    # LiteLLM wraps the id: base64 of "litellm:...;response_id:<ours>"
    ours = base64.b64decode(got["id"].removeprefix("resp_")).decode().split("response_id:")[-1]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stored = client.responses.retrieve(ours)
    assert stored.output_text == got["text"] and stored.usage.output_tokens == got["usage"]


THINKING = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import ModelSettings, ModelTracing, OpenAIResponsesModel, set_tracing_disabled

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="EMPTY", max_retries=0)
model = OpenAIResponsesModel(model="default", openai_client=client)
ASK = [{"role": "user", "content": "Weather in Paris?"}]

def args(thinking):  # the SDK takes an incomplete response for a failure: a stop ends it
    settings = ModelSettings(max_tokens=6, temperature=0, extra_body={
        "chat_template_kwargs": {"enable_thinking": thinking}, "stop": [STOPS[str(thinking)]]})
    return (None, ASK, settings, [], None, [], ModelTracing.DISABLED)

async def main():
    result = {}
    for thinking in (True, False):
        got = await model.get_response(*args(thinking))
        kinds, final = [], None
        async for event in model.stream_response(*args(thinking)):
            kinds.append(event.type)
            if event.type == "response.completed":
                final = event.response
        result[str(thinking)] = {
            "output": [i.model_dump() for i in got.output],
            "reasoning_tokens": got.usage.output_tokens_details.reasoning_tokens,
            "output_tokens": got.usage.output_tokens, "kinds": kinds,
            "streamed": [i.model_dump() for i in final.output],
            "streamed_reasoning_tokens": final.usage.output_tokens_details.reasoning_tokens}
        if thinking:  # the reasoning item back as input, as the SDK replays a turn
            items = ASK + got.to_input_items() + [
                {"role": "user", "content": "And Rome?"}]
            again = await client.responses.create(model="default", input=items,
                                                  max_output_tokens=2)
            result["replayed"] = [i.type for i in again.output]
    print("RESULT " + json.dumps(result))

asyncio.run(main())
"""


def _reasoning(output: list[dict]) -> list[str]:
    return [part["text"] for item in output if item["type"] == "reasoning"
            for part in item["content"]]


def _stop_inside(client, thinking: bool) -> tuple[str, str]:
    """A stop string met halfway through the greedy answer (so the response completes),
    and the text before it."""
    text = client.responses.create(
        model="default", input="Weather in Paris?", max_output_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}}).output[0]
    whole = text.content[0].text
    stop = whole[len(whole) // 2:]
    assert whole.find(stop) > 0, whole
    return stop, whole[:whole.find(stop)]


def test_agents_sdk_model_shows_and_switches_thinking(server):
    """``enable_thinking`` in ``chat_template_kwargs`` opens ``<think>``: the answer is a
    ``reasoning`` item (OpenAI's shape), streamed as ``response.reasoning_text`` events,
    counted in ``reasoning_tokens``; without it there is no reasoning. Random weights
    write no ``</think>``, so with thinking on, all of it is thinking."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    (stop_on, thought), (stop_off, said) = _stop_inside(client, True), _stop_inside(client, False)
    stops = json.dumps({"True": stop_on, "False": stop_off})
    got = run_client(f"STOPS = {stops}\n" + THINKING, server.url)
    on, off = got["True"], got["False"]
    assert [i["type"] for i in on["output"]] == ["reasoning"], on["output"]
    assert _reasoning(on["output"]) == [thought] == _reasoning(on["streamed"])
    assert on["output"][0]["summary"] == [] and on["output"][0]["status"] == "completed"
    assert 1 <= on["reasoning_tokens"] <= on["output_tokens"]
    assert on["streamed_reasoning_tokens"] == on["reasoning_tokens"]
    kinds = on["kinds"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "response.reasoning_text.delta" in kinds
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [i["type"] for i in off["output"]] == ["message"]
    assert off["output"][0]["content"][0]["text"] == said
    assert not _reasoning(off["streamed"]) and not any("reasoning" in k for k in off["kinds"])
    assert off["reasoning_tokens"] == off["streamed_reasoning_tokens"] == 0
    assert got["replayed"], got


def test_stored_reasoning_is_read_and_carried(server):
    """A stored thinking response: GET returns its reasoning item, and a continuation
    renders it as the assistant turn's reasoning_content (accepted, not a 400)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    first = client.responses.create(
        model="default", input="Weather in Paris?", max_output_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    stored = client.responses.retrieve(first.id)
    assert [i.type for i in stored.output] == ["reasoning"]
    assert stored.output[0].content[0].text == first.output[0].content[0].text
    assert stored.usage.output_tokens_details.reasoning_tokens == 6
    second = client.responses.create(model="default", input="And Rome?", max_output_tokens=2,
                                      previous_response_id=first.id, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
