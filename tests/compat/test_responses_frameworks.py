"""The agent frameworks against radixlm's Responses API (``/v1/responses``): the Agents SDK's
default model class (``OpenAIResponsesModel``) completes a run, and a function-tool round
trip (the model calls the tool, the SDK runs it and sends its output back); LiteLLM's
``litellm.responses``. Each client runs in the frameworks' own venv (``agent_frameworks``)."""

from __future__ import annotations

import base64
import json

import openai
import pytest

from tests.compat.agent_frameworks import run_client

# the tool round trip's turn after the call is tool_choice 'auto': it needs a parser
FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0",
         "--tool-call-parser", "qwen25"]

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
def server(module_server):
    return module_server(FLAGS)


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
