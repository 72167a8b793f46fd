"""A streamed response costs what its length does: the text, thinking and call arguments of
open items are not copied at each delta (a 40k-character output in 8-character deltas held
~100 MB over its deltas when each grew a string; now a few hundred bytes a character), and
the closing events still carry everything that was streamed. Counted with tracemalloc, not
timed."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from radixlm.runtime.entrypoints.openai.responses_stream import ResponseEvents

CHARS, STEP = 40_000, 8


def _deltas(kind: str) -> list[dict]:
    text = "".join(chr(97 + i % 26) for i in range(CHARS))
    pieces = [text[i:i + STEP] for i in range(0, CHARS, STEP)]
    if kind == "text":
        return [{"content": p} for p in pieces]
    if kind == "reasoning":
        return [{"reasoning_content": p} for p in pieces]
    first = {"tool_calls": [{"index": 0, "id": "call_1",
                             "function": {"name": "f", "arguments": ""}}]}
    return [first, *({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}
                     for p in pieces)]


def _events() -> ResponseEvents:
    return ResponseEvents({"id": "resp_1", "object": "response", "status": "in_progress",
                           "output": []}, want_logprobs=False)


@pytest.mark.parametrize("kind", ["text", "reasoning", "arguments"])
def test_each_delta_holds_what_it_brings(kind: str) -> None:
    events, held = _events(), 0
    events.begin()
    tracemalloc.start()
    try:
        for delta in _deltas(kind):
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            events.delta(delta, None)
            held += tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert held <= 400 * CHARS, f"{held / CHARS:.0f} bytes held per character of output"


@pytest.mark.parametrize("kind", ["text", "reasoning", "arguments"])
def test_the_closing_events_carry_the_whole_stream(kind: str) -> None:
    events = _events()
    events.begin()
    streamed = []
    for delta in _deltas(kind):
        for chunk in events.delta(delta, None):
            data = json.loads(chunk.split(b"data: ", 1)[1])
            streamed.append(data.get("delta", ""))
    final = json.loads(events.finish("completed", {}, None)[-1].split(b"data: ", 1)[1])
    (item,) = final["response"]["output"]
    whole = {"text": lambda: item["content"][0]["text"],
             "reasoning": lambda: item["content"][0]["text"],
             "arguments": lambda: item["arguments"]}[kind]()
    assert whole == "".join(streamed) and len(whole) == CHARS
