"""Each --tool-call-parser format on text: the whole-text parse, and the stream cut at
every split point reassembling to exactly the same content and calls."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.entrypoints.openai.function_call import ToolCallParser, tool_call_format
from radixlm.runtime.entrypoints.openai.function_call.json_array import JsonArrayFormat

W = '{"city": "Paris", "days": [1, "x}"]}'
CASES = {
    "qwen25": (f'Sure. <tool_call>\n{{"name": "f", "arguments": {W}}}\n</tool_call>\n'
               '<tool_call>\n{"arguments": {"b": 2}, "name": "g"}\n</tool_call>',
               "Sure.", [("f", W), ("g", '{"b": 2}')]),
    "llama3": (f'<|python_tag|>{{"name": "f", "parameters": {W}}}; '
               '{"name": "g", "parameters": {}}', None, [("f", W), ("g", "{}")]),
    "mistral": (f'Let me check. [TOOL_CALLS] [{{"name": "f", "arguments": {W}}}, '
                '{"name": "g", "arguments": {"s": "]"}}]', "Let me check.",
                [("f", W), ("g", '{"s": "]"}')]),
    "pythonic": ('ok [f(city="Paris", days=[1, "x)"]), g(c=None, d=True)]', "ok",
                 [("f", '{"city": "Paris", "days": [1, "x)"]}'),
                  ("g", '{"c": null, "d": true}')]),
    "gpt-oss": ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>'
                f'{W}<|call|>', None, [("f", W)]),
}


def _stream(fmt, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallParser(fmt)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    events = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    for piece, deltas in [*events, parser.finish()]:
        content += piece
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.name, "id and name first, once per call"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_text(name):
    text, content, calls = CASES[name]
    got_content, got = ToolCallParser(tool_call_format(name)).parse(text)
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_at_every_split(name):
    text, _, calls = CASES[name]
    for cut in range(1, len(text)):
        content, got = _stream(tool_call_format(name), text, [cut])
        assert got == calls, (cut, got)
        assert content.strip() == (CASES[name][1] or ""), (cut, content)
    content, got = _stream(tool_call_format(name), text, list(range(1, len(text))))
    assert got == calls  # one character at a time


@pytest.mark.parametrize("name, text", [
    ("qwen25", "a <tool_call> not json </tool_call> b"),
    ("llama3", '{"nam": 1} is a dict'),
    ("mistral", "[TOOL_CALLS] oops"),
    ("pythonic", "see [1, 2] and [x y]"),
])
def test_text_that_is_not_a_call_stays_text(name, text):
    content, calls = ToolCallParser(tool_call_format(name)).parse(text)
    assert calls == [] and content == text
    streamed, got = _stream(tool_call_format(name), text, list(range(1, len(text), 3)))
    assert got == [] and streamed == text


def test_a_call_cut_short_is_text_when_whole():
    """(A stream has sent its name and arguments so far by then, as vLLM's does.)"""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    assert ToolCallParser(tool_call_format("qwen25")).parse(text) == (text, [])
    assert _stream(tool_call_format("qwen25"), text, [len(text) - 3])[1] == [("f", '{"a": 1')]


def test_forced_json_array_and_max_calls():
    text = f'[{{"name": "f", "parameters": {W}}}, {{"name": "g", "parameters": {{}}}}]'
    content, calls = ToolCallParser(JsonArrayFormat()).parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", json.loads(W)), ("g", {})]
    _, one = ToolCallParser(JsonArrayFormat(), max_calls=1).parse(text)
    assert [c.name for c in one] == ["f"]
    for cut in range(1, len(text)):
        assert _stream(JsonArrayFormat(), text, [cut])[1] == [("f", W), ("g", "{}")]


def test_harmony_text_and_analysis_are_text():
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hello!<|return|>")
    content, calls = ToolCallParser(tool_call_format("gpt-oss")).parse(text)
    assert calls == [] and content == "thinkHello!"
    for cut in range(1, len(text)):
        assert _stream(tool_call_format("gpt-oss"), text, [cut])[0] == "thinkHello!"


@pytest.mark.parametrize("name, text", [
    ("qwen25", '<tool_call>{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>"),
    ("qwen25", '<tool_call>{"name": "f\nx", "arguments": {}}</tool_call>'),
    ("mistral", "[TOOL_CALLS]f[ARGS]" + "9" * 5000),
])
def test_json_that_python_cannot_read_is_text(name, text):
    """An integer past Python's 4,300 digits, a raw newline in a name: json raised through
    the parser (a 500, or a stream cut off); they are text."""
    assert ToolCallParser(tool_call_format(name)).parse(text) == (text, [])
    assert _stream(tool_call_format(name), text, list(range(1, len(text), 7)))[0] == text


@pytest.mark.parametrize("name, text, calls", [
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"a": 1}', [("get_weather", '{"a": 1}')]),
    ("pythonic", "[f (a=1)]", [("f", '{"a": 1}')]),
])
def test_a_stream_cut_inside_a_marker_is_what_the_whole_text_is(name, text, calls):
    """Cut inside ``[ARGS]`` or before ``(``, a stream gave out the text as content, then
    the call: now it waits, as the whole-text parse reads it."""
    got = ToolCallParser(tool_call_format(name)).parse(text)[1]
    assert [(c.name, c.arguments) for c in got] == calls
    for cut in range(1, len(text)):
        assert _stream(tool_call_format(name), text, [cut]) == ("", calls), cut
