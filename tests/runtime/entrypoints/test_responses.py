"""OpenAI's Responses API (``/v1/responses``) through the official openai client: a response
is the chat completion of the same conversation (the oracle: same text, same prompt tokens),
``previous_response_id`` carries the conversation, the store is bounded and ``store: false``
keeps nothing, streaming sends OpenAI's events in order, ``text.format`` json_schema output
validates, and fields radixlm cannot serve are 400s naming them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

STORE_SIZE = 4
FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0",
         "--max-stored-responses", str(STORE_SIZE)]
GREEDY = {"model": "default", "temperature": 0}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(module_server):
    return module_server(FLAGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)


def test_response_is_the_chat_completion_of_its_conversation(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a "},
                          {"type": "input_text", "text": "colour."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Red.",
                                                "annotations": []}]},
             {"role": "user", "content": "Another?"}]
    resp = client.responses.create(input=items, instructions="You are terse.",
                                    max_output_tokens=6, **GREEDY)
    chat = _chat(client, [{"role": "system", "content": "You are terse."},
                          {"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Name a colour."},
                          {"role": "assistant", "content": "Red."},
                          {"role": "user", "content": "Another?"}], 6)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and item.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.instructions == "You are terse." and resp.max_output_tokens == 6


def test_length_is_incomplete_and_logprobs_are_included(client):
    resp = client.responses.create(input="Count:", max_output_tokens=3, top_logprobs=2,
                                   include=["message.output_text.logprobs"],
                                   extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    lps = resp.output[0].content[0].logprobs
    assert len(lps) == 3 == resp.usage.output_tokens
    assert "".join(lp.token for lp in lps) == resp.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)


def test_previous_response_id_carries_the_conversation(client):
    first = client.responses.create(input="Hello there, tell me a story.", instructions="Sys.",
                                    max_output_tokens=5, **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id,
                                      max_output_tokens=4, **GREEDY)
    # instructions are not carried over (OpenAI's rule); the first turn and its answer are
    history = [{"role": "user", "content": "Hello there, tell me a story."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    chat = _chat(client, history, 4)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 3
    # a third turn reuses the second's prompt from the radix cache
    third = client.responses.create(input="End.", previous_response_id=second.id,
                                    max_output_tokens=2, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 1


def test_store_false_keeps_nothing_and_unknown_ids_are_404(client):
    resp = client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Hi", previous_response_id=resp.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_retrieve_delete_input_items_and_the_store_bound_evicts(client, server):
    made = [client.responses.create(input=f"Turn {i}", max_output_tokens=2, metadata={
        "i": str(i)}, **GREEDY) for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):  # least recently used, evicted
        client.responses.retrieve(made[0].id)
    got = client.responses.retrieve(made[-1].id)
    assert got.id == made[-1].id and got.output_text == made[-1].output_text
    assert got.metadata == {"i": str(STORE_SIZE)} and got.usage == made[-1].usage
    items = client.responses.input_items.list(made[-1].id)
    assert [i.content[0].text for i in items.data] == [f"Turn {STORE_SIZE}"]
    bad = httpx.get(f"{server.url}/v1/responses/{made[-1].id}/input_items?order=sideways",
                    timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "order"
    client.responses.delete(made[-1].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[-1].id)
    cancel = httpx.post(f"{server.url}/v1/responses/{made[1].id}/cancel", timeout=10)
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]


def test_streaming_events(client):
    stream = client.responses.create(input="Tell me", max_output_tokens=4, stream=True,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == events[-4].text
    assert final.usage.output_tokens == 4 and final.status == "incomplete"
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {final.output[0].id}
    assert client.responses.retrieve(final.id).output_text == text
    same = client.responses.create(input="Tell me", max_output_tokens=4,
                                   extra_body={"ignore_eos": True}, **GREEDY)
    assert same.output_text == text


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "flag", "schema": FLAG, "strict": True}
    resp = client.responses.create(input="A flag", max_output_tokens=64, text={"format": fmt},
                                   model="default", temperature=0.7, extra_body={"seed": 5})
    assert resp.status == "completed", resp.output_text
    jsonschema.validate(json.loads(resp.output_text), FLAG)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "flag"
    with client.responses.stream(input="A flag", max_output_tokens=64, text={"format": fmt},
                                 model="default", temperature=0.7,
                                 extra_body={"seed": 6}) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), FLAG)


@pytest.mark.parametrize("extra, param, word", [
    ({"background": True}, "background", "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"include": ["file_search_call.results"]}, "include[0]", "not supported"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "instructions"),
    ({"max_tool_calls": 2}, "max_tool_calls", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "text-only"),
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input[0].type",
     "not supported"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gA"}]},
     "input[0].encrypted_content", "encrypted"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "Input should be"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "required"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"model": "gpt-9"}, "model", "does not exist"),
])
def test_what_radixlm_cannot_serve_is_a_400_naming_it(client, extra, param, word):
    body = {"input": "Hi", "max_output_tokens": 2, **extra}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        client.responses.create(**{k: v for k, v in body.items()
                                   if k in ("input", "max_output_tokens", "model")},
                                extra_body={k: v for k, v in body.items()
                                            if k not in ("input", "max_output_tokens",
                                                         "model")})
    err = e.value.body
    assert err["param"] == param and word in err["message"], err


def test_neutral_values_and_unknown_fields_are_served(client, server):
    resp = client.responses.create(
        input="Hi", max_output_tokens=2, truncation="disabled", service_tier="auto",
        reasoning={}, include=[], tool_choice="none", parallel_tool_calls=False, user="u1",
        prompt_cache_key="k", extra_body={"some_future_field": 1}, **GREEDY)
    assert resp.output_text is not None and resp.parallel_tool_calls is False
    assert "ignoring unknown field 'some_future_field'" in server.log()


# --- function tools --------------------------------------------------------------------------
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                     "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def test_forced_function_call_and_its_output_round_trip(client):
    choice = {"type": "function", "name": "get_weather"}
    resp = client.responses.create(input="Weather in Paris?", tools=[WEATHER],
                                   tool_choice=choice, max_output_tokens=48, **GREEDY)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.id.startswith("fc_") for c in calls)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    back = client.responses.create(
        previous_response_id=resp.id, tools=[WEATHER], tool_choice="none",
        max_output_tokens=4, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                     "output": "sunny"}], **GREEDY)
    replay = client.responses.create(
        input=[{"role": "user", "content": "Weather in Paris?"},
               *[c.model_dump(exclude_none=True) for c in calls],
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}],
        tools=[WEATHER], tool_choice="none", max_output_tokens=4, **GREEDY)
    assert back.usage.input_tokens == replay.usage.input_tokens > resp.usage.input_tokens
    assert back.output_text == replay.output_text
    stream = client.responses.create(input="Weather in Paris?", tools=[WEATHER],
                                     tool_choice=choice, max_output_tokens=48, stream=True,
                                     **GREEDY)
    events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done[0].arguments == args == calls[0].arguments
    assert events[-1].type == "response.completed"
