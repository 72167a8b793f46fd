"""OpenAI features radixlm does not implement yet are a 400 naming them (never an answer
that silently ignores them), ``GET /v1/models/{id}`` answers, and validation errors carry
``param`` where a field is at fault — checked with the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0"]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(module_server):
    return module_server(FLAGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _refused(call, param: str, word: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    body = e.value.body if isinstance(e.value.body, dict) else {}
    assert body.get("param") == param and word in body.get("message", ""), e.value.body


@pytest.mark.parametrize("extra, param, word", [
    # tool_choice auto (the default with tools) needs a parser: never plain text silently
    ({"tools": [TOOL]}, "tool_choice", "--tool-call-parser"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"functions": [TOOL["function"]]}, "function_call", "--tool-call-parser"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
])
def test_chat_features_we_lack_are_400(client, extra, param, word):
    _refused(lambda: client.chat.completions.create(
        model="default", messages=USER, max_tokens=4, extra_body=extra), param, word)


def test_forced_tools_and_tool_history_are_served(client):
    """Without --tool-call-parser: required and named choices (a JSON array of calls, as
    vLLM) and a history with calls and results (tests/.../function_call/ test them)."""
    chat = client.chat.completions.create(
        model="default", messages=USER, max_tokens=60, tools=[TOOL], tool_choice={
            "type": "function", "function": {"name": "get_weather"}})
    assert chat.choices[0].finish_reason in ("tool_calls", "length")
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    chat = client.chat.completions.create(model="default", messages=history, max_tokens=4)
    assert chat.usage.completion_tokens > 0


def test_neutral_values_are_served(client):
    chat = client.chat.completions.create(
        model="default", messages=USER, max_tokens=4, tools=[TOOL], tool_choice="none",
        extra_body={"modalities": ["text"]})
    assert chat.choices[0].message.tool_calls is None and chat.usage.completion_tokens > 0
    done = client.completions.create(model="default", prompt="Hello", max_tokens=4,
                                     suffix="")
    assert done.usage.completion_tokens > 0
    _refused(lambda: client.completions.create(model="default", prompt="Hello",
                                               max_tokens=4, suffix=" world"),
             "suffix", "fill-in-the-middle")


def test_retrieve_model(client, server):
    served = client.models.list().data[0].id
    card = client.models.retrieve(served)
    assert card.id == served and card.object == "model"
    assert httpx.get(server.url + "/v1/models/default").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("kwargs, param", [({"temperature": -1}, "temperature"),
                                           ({"n": 1000}, "n")])
def test_errors_name_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=USER, max_tokens=4,
                                       **kwargs)
    assert e.value.body["param"] == param, e.value.body
