"""The translation between Responses items and chat shapes (``responses_items.py``,
``responses_stream.py``), without a server: function_call / function_call_output items
become assistant ``tool_calls`` and ``tool`` messages, a chat choice's calls become
``function_call`` items, and chat deltas with tool calls become OpenAI's call events."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.entrypoints.openai.responses_items import (
    chat_tool_choice,
    chat_tools,
    history_messages,
    input_messages,
    output_items,
)
from radixlm.runtime.entrypoints.openai.responses_stream import ResponseEvents
from radixlm.runtime.managers.api_error import ApiError

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}


def test_calls_and_outputs_become_chat_messages():
    messages = input_messages([
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
    ])
    assert messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]


def test_tools_and_tool_choice_in_chat_shape():
    tools = chat_tools([{"type": "function", "name": "f", "description": "d", "strict": True,
                         "parameters": {"type": "object"}}])
    assert tools == [{"type": "function", "function": {
        "name": "f", "description": "d", "strict": True, "parameters": {"type": "object"}}}]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    with pytest.raises(ApiError) as e:
        chat_tools([{"type": "function", "name": "f", "defer_loading": True}])
    assert e.value.param == "tools[0].defer_loading"


def test_chat_calls_become_function_call_items_and_history():
    choice = {"message": {"role": "assistant", "content": None, "tool_calls": [CALL]}}
    [item] = output_items(choice, "completed", want_logprobs=False)
    assert item["type"] == "function_call" and item["call_id"] == "call_1"
    assert item["name"] == "get_weather" and json.loads(item["arguments"]) == {"city": "Paris"}
    assert history_messages([item]) == [
        {"role": "assistant", "content": None, "tool_calls": [CALL]}]


def _events(chunks: list[bytes]) -> list[dict]:
    return [json.loads(c.split(b"\ndata: ", 1)[1]) for c in chunks]


def test_streamed_calls_become_call_events():
    events = ResponseEvents({"id": "resp_1", "output": []}, want_logprobs=False)
    chunks = events.begin()
    chunks += events.delta({"role": "assistant", "content": "Hm."}, None)
    chunks += events.delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                            "function": {"name": "get_weather",
                                                         "arguments": ""}}]}, None)
    for part in ("{\"city\"", ": \"Paris\"}"):
        chunks += events.delta({"tool_calls": [{"index": 0, "function": {
            "arguments": part}}]}, None)
    chunks += events.finish("completed", {"input_tokens": 1}, None)
    got = _events(chunks)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = got[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    call = final["output"][1]
    assert call["arguments"] == "{\"city\": \"Paris\"}" == got[11]["arguments"]
    assert call["call_id"] == "call_1" and call["status"] == "completed"
    assert got[9]["output_index"] == 1 and got[9]["item_id"] == call["id"]


def test_items_are_kept_as_read_without_the_fields_the_server_ignores():
    """What the store keeps of the input is what the server read: a field it ignores (here
    a 100 kB one) is not kept, so the stored bytes are the validated items'."""
    junk = "j" * 100_000
    kept: list[dict] = []
    input_messages([
        {"role": "user", "content": "Hi", "junk": junk},
        {"type": "message", "role": "assistant", "id": "msg_9", "status": "completed",
         "content": [{"type": "output_text", "text": "Yo", "annotations": [junk]}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
         "extra": junk},
    ], kept)
    assert junk not in json.dumps(kept)
    assert [item["type"] for item in kept] == ["message", "message", "function_call"]
    assert kept[0]["id"].startswith("msg_") and kept[1]["id"] == "msg_9"
    assert kept[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert kept[1]["content"] == [{"type": "output_text", "text": "Yo"}]
    assert kept[2] == {"id": kept[2]["id"], "type": "function_call", "call_id": "c1",
                       "name": "f", "arguments": "{}"}


REASONING = {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Think."}]}


def test_reasoning_items_in_and_out():
    """A chat choice's reasoning_content is a reasoning item before the message (OpenAI's
    ResponseReasoningItem); replayed, it is the assistant turn's reasoning_content."""
    choice = {"message": {"role": "assistant", "content": "Paris.",
                          "reasoning_content": "Think."}}
    items = output_items(choice, "completed", want_logprobs=False)
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
    assert items[0]["summary"] == [] and items[0]["id"].startswith("rs_")
    assert history_messages(items) == [
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Think."}]
    thinking_only = output_items({"message": {"role": "assistant", "content": None,
                                              "reasoning_content": "Hm"}}, "incomplete", False)
    assert [i["type"] for i in thinking_only] == ["reasoning"]
    messages = input_messages([{"role": "user", "content": "Q"}, REASONING,
                               {"type": "function_call", "call_id": "c", "name": "f",
                                "arguments": "{}"}])
    assert messages[1]["reasoning_content"] == "Think." and messages[1]["tool_calls"]
    with pytest.raises(ApiError) as e:
        input_messages([{**REASONING, "encrypted_content": "gAAAA"}])
    assert e.value.param == "input[0].encrypted_content"


def test_streamed_reasoning_becomes_reasoning_events():
    events = ResponseEvents({"id": "resp_1", "output": []}, want_logprobs=False)
    chunks = events.begin()
    chunks += events.delta({"role": "assistant", "reasoning_content": "Let me "}, None)
    chunks += events.delta({"reasoning_content": "think."}, None)
    chunks += events.delta({"content": "Paris."}, None)
    chunks += events.finish("completed", {"input_tokens": 1}, None)
    got = _events(chunks)
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    rs = got[-1]["response"]["output"][0]
    assert rs["type"] == "reasoning" and rs["status"] == "completed"
    assert rs["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert got[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert got[6]["text"] == "Let me think." and got[6]["item_id"] == rs["id"]
    assert events.reasoning_text == "Let me think."
    assert got[9]["output_index"] == 1
