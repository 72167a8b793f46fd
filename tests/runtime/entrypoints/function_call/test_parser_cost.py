"""Every tool-call and reasoning parser is linear in its output (issue 55).

Each case reads a 100k-character output whole and streamed in 8-character deltas, and
counts the work, not the time: the Python lines run in the parsers' modules, the characters
their regexes, JSON decoder, ``json.loads`` and ``ast.parse`` examine, and the memory each
delta holds (a copy of the text so far, at each delta, is quadratic; the parsers grow their
text in place, which CPython does unless a tracer such as coverage runs). Each count must
stay under a constant times the length. Re-reading the whole text at each delta (how the
parsers were written before) passes a bound in every case: a pythonic stream of an
unclosed 100k-character call took 107 s of CPU, now 0.05 s (``benchmarks/parser_cost.py``).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

import radixlm.runtime.entrypoints.openai.chat_output as chat_output_module
import radixlm.runtime.entrypoints.openai.reasoning_parser as reasoning_module
from radixlm.runtime.entrypoints.openai import function_call
from radixlm.runtime.entrypoints.openai.chat_output import ChoiceOutput
from radixlm.runtime.entrypoints.openai.function_call import ToolCallParser, tool_call_format
from radixlm.runtime.entrypoints.openai.function_call.json_array import JsonArrayFormat
from radixlm.runtime.entrypoints.openai.reasoning_parser import ReasoningParser

N = 100_000
STEP = 8
LINES_PER_CHAR = 60  # Python lines run in the parsers
SCANNED_PER_CHAR = 12  # characters examined by regexes, the JSON decoder and ast.parse
BYTES_PER_CHAR = 400  # the most each delta allocates at once, summed over the deltas

PARSER_FILES = (str(Path(function_call.__file__).parent), reasoning_module.__file__,
                chat_output_module.__file__)
PARSER_MODULES = [m for name, m in sorted(sys.modules.items())
                  if name.startswith(function_call.__name__) or m is reasoning_module]


class _OverBudget(Exception):
    pass


def _count_lines(run: Callable[[], object], budget: int) -> int:
    """Lines run in the parsers' files by ``run()``; stops past ``budget``."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise _OverBudget
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PARSER_FILES) else None

    sys.settrace(calls)
    try:
        run()
    except _OverBudget:
        pass
    finally:
        sys.settrace(None)
    return count


class _Counter:
    """Characters examined; stops the run past ``budget``."""

    def __init__(self, budget: int) -> None:
        self.count, self.budget = 0, budget

    def add(self, n: int) -> None:
        self.count += n
        if self.count > self.budget:
            raise _OverBudget


class _CountingPattern:
    """A compiled regex that adds the characters each call examined to ``counter``."""

    def __init__(self, pattern: re.Pattern, counter: _Counter) -> None:
        self.pattern, self.counter = pattern, counter

    def __getattr__(self, name: str):
        method = getattr(self.pattern, name)
        if name not in ("match", "search", "fullmatch"):
            return method

        def counted(string, pos=0, endpos=sys.maxsize):
            m = method(string, pos, endpos)
            self.counter.add((m.end() if m else min(endpos, len(string))) - pos)
            return m
        return counted


class _CountingDecoder(json.JSONDecoder):
    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def raw_decode(self, s, idx=0):
        try:
            obj, end = super().raw_decode(s, idx)
        except ValueError:  # it may have read to the end (an unterminated string)
            self.counter.add(len(s) - idx)
            raise
        self.counter.add(end - idx)
        return obj, end


def _count_scanned(monkeypatch: pytest.MonkeyPatch, run: Callable[[], object],
                   budget: int) -> int:
    """Characters that the parsers' regexes, JSON decoder, json.loads and ast.parse examine;
    stops past ``budget``."""
    counter = _Counter(budget)
    for module in PARSER_MODULES:
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern):
                monkeypatch.setattr(module, name, _CountingPattern(value, counter))
            elif isinstance(value, json.JSONDecoder):
                monkeypatch.setattr(module, name, _CountingDecoder(counter))
            elif isinstance(value, dict) and any(isinstance(v, re.Pattern)
                                                 for v in value.values()):
                monkeypatch.setattr(module, name, {k: _CountingPattern(v, counter)
                                                   for k, v in value.items()})
    loads, parse = json.loads, ast.parse

    def counted_loads(s, *args, **kwargs):
        counter.add(len(s))
        return loads(s, *args, **kwargs)

    def counted_parse(source, *args, **kwargs):
        counter.add(len(source))
        return parse(source, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counted_loads)
    monkeypatch.setattr(ast, "parse", counted_parse)
    try:
        run()
    except _OverBudget:
        pass
    finally:
        monkeypatch.undo()
    return counter.count


def _peak_bytes(parser, deltas: list[str], budget: int) -> int:
    """The most memory each ``parser.feed(delta)`` (and ``finish()``) holds at once, summed;
    stops past ``budget``."""
    total = 0
    tracemalloc.start()
    try:
        for delta in [*deltas, None]:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            if delta is None:
                parser.finish()
            else:
                parser.feed(delta)
            total += tracemalloc.get_traced_memory()[1] - before
            if total > budget:
                break
    finally:
        tracemalloc.stop()
    return total


def _stream(new_parser: Callable[[], object], text: str) -> Callable[[], None]:
    def run() -> None:
        parser = new_parser()
        for i in range(0, len(text), STEP):
            parser.feed(text[i:i + STEP])
        parser.finish()
    return run


def _fill(head: str, unit: str, tail: str = "") -> str:
    """``head``, ``unit`` repeated, spaces, ``tail``: N characters in all."""
    units = unit * ((N - len(head) - len(tail)) // len(unit))
    return head + units.ljust(N - len(head) - len(tail)) + tail


ARGS = '{"city": "' + "Paris, " * 2 + '", "notes": ["a", {"b": "c\\" ]} x"}, 1], "text": "'
TOOL_CASES = {
    # the finding: a call forced open, the list never closed
    "pythonic-unclosed": ("pythonic", _fill('[get_weather(city="', "Paris, ")),
    "pythonic-closed": ("pythonic", _fill('ok <|python_start|>[f(a="', "x) ] 'y' ",
                                          '")]<|python_end|> done')),
    # a trigger in every few characters of a call left open: each is tried at the end
    "pythonic-nested": ("pythonic", _fill("", '[f(a="x", b=')),
    "pythonic-nested-strings": ("pythonic", _fill("", "[f(a='[g(\\'")),
    "pythonic-long-name": ("pythonic", _fill("[", "get_weather_", "(a=1)]")),
    "qwen25": ("qwen25", _fill('Sure. <tool_call>\n{"name": "f", "arguments": ' + ARGS,
                               "it's \\\" {[ ", '"}}\n</tool_call>')),
    "qwen25-unclosed-name": ("qwen25", _fill('<tool_call>\n{"name": "', "get_weather")),
    "qwen25-other-order": ("qwen25", _fill('<tool_call>{"arguments": ' + ARGS, "x ",
                                           '"}, "name": "f"}</tool_call>')),
    "qwen25-nested": ("qwen25", _fill("", '<tool_call>{"name": "f", "arguments": {"a": ')),
    "qwen25-many-calls": ("qwen25", _fill("", '<tool_call>\n{"name": "f", "arguments": '
                                          '{"a": 1}}\n</tool_call>\n')),
    "llama3": ("llama3", _fill('<|python_tag|>{"name": "f", "parameters": ' + ARGS, "a b ",
                               '"}}')),
    "llama3-many-calls": ("llama3", _fill("<|python_tag|>", '{"name": "f", "parameters": '
                                          '{"a": [1]}}; ')),
    "llama3-nested": ("llama3", _fill("", '{"name": "f", "parameters": {"a": [')),
    "llama3-spaces-after-call": ("llama3", _fill('{"name": "f", "parameters": {}}', "  \n")),
    "mistral": ("mistral", _fill('[TOOL_CALLS] [{"name": "f", "arguments": ' + ARGS, "z ",
                                 '"}}]')),
    "mistral-many-calls": ("mistral", _fill("[TOOL_CALLS] [", '{"name": "f", "arguments": '
                                            '{"s": "]"}}, ', '{"name": "g", "arguments": {}}]')),
    "mistral-nested": ("mistral", _fill("", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": ')),
    "mistral-compact": ("mistral", _fill("[TOOL_CALLS]get_weather[ARGS]" + ARGS, "q ", '"}')),
    "json_array": ("json_array", _fill('[{"name": "f", "parameters": ' + ARGS, "w ", '"}}]')),
    "gpt-oss-call": ("gpt-oss", _fill("<|channel|>commentary to=functions.f <|constrain|>json"
                                      "<|message|>" + ARGS, "<| ", '"}<|call|>')),
    "gpt-oss-nested": ("gpt-oss", _fill("", "<|channel|>commentary to=functions.f <|message|>"
                                        '{"a": [')),
    "gpt-oss-text": ("gpt-oss", _fill("<|start|>assistant<|channel|>final<|message|>", "Hi <|",
                                      "<|return|>")),
    "plain-text": ("qwen25", _fill("", "Just text, no call <tool_ ")),
}


def _tool_parser(name: str) -> Callable[[], ToolCallParser]:
    fmt = JsonArrayFormat() if name == "json_array" else tool_call_format(name)
    return lambda: ToolCallParser(fmt)


REASONING_CASES = {
    "qwen3": ("qwen3", False, _fill("<think>\n", "Plan it. </thin ", "</think>\n\nAnswer.")),
    "qwen3-unclosed": ("qwen3", True, _fill("", "  \n < /")),
    "deepseek-r1-answer": ("deepseek-r1", False, _fill("R1 thinks</think>", "Answer <th ")),
    "gpt-oss": ("gpt-oss", False, _fill("<|channel|>analysis<|message|>", "Think <|en ",
                                        "<|end|><|start|>assistant<|channel|>final<|message|>"
                                        "Hi<|return|>")),
    "gpt-oss-many": ("gpt-oss", False, _fill("", "<|channel|>analysis<|message|>a<|end|>b ")),
}


def _reasoning_parser(name: str, opens: bool) -> Callable[[], ReasoningParser]:
    return lambda: ReasoningParser(name, opens)


class _HeldThinking:
    """A chat choice whose thinking is held until it ends (``stream_reasoning: false``)."""

    def __init__(self) -> None:
        self.out = ChoiceOutput(ReasoningParser("qwen3"), None, stream_reasoning=False)

    def parse(self, text: str) -> dict:
        return self.out.message(text)

    def feed(self, delta: str) -> dict:
        return self.out.delta(delta)

    def finish(self) -> dict:
        return self.out.delta("", final=True)


def _check_linear(new_parser: Callable, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(text) == N
    whole = lambda: new_parser().parse(text)  # noqa: E731
    streamed = _stream(new_parser, text)
    for label, run in (("whole", whole), ("streamed", streamed)):
        lines = _count_lines(run, LINES_PER_CHAR * N)
        assert lines <= LINES_PER_CHAR * N, f"{label}: over {LINES_PER_CHAR} lines run a char"
        scanned = _count_scanned(monkeypatch, run, SCANNED_PER_CHAR * N)
        assert scanned <= SCANNED_PER_CHAR * N, (
            f"{label}: over {SCANNED_PER_CHAR} characters scanned a char")
    if sys.gettrace() is not None:  # a tracer (coverage) stops CPython growing a str in place
        return
    deltas = [text[i:i + STEP] for i in range(0, len(text), STEP)]
    held = _peak_bytes(new_parser(), deltas, BYTES_PER_CHAR * N)
    assert held <= BYTES_PER_CHAR * N, f"streamed: over {BYTES_PER_CHAR} bytes held a char"


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_tool_call_parser_is_linear(case, monkeypatch):
    name, text = TOOL_CASES[case]
    _check_linear(_tool_parser(name), text, monkeypatch)


@pytest.mark.parametrize("case", sorted(REASONING_CASES))
def test_reasoning_parser_is_linear(case, monkeypatch):
    name, opens, text = REASONING_CASES[case]
    _check_linear(_reasoning_parser(name, opens), text, monkeypatch)


def test_thinking_held_until_it_ends_is_linear(monkeypatch):
    _check_linear(_HeldThinking, REASONING_CASES["qwen3"][2], monkeypatch)


def test_cases_parse_as_intended():
    """The cases are what their names say (so the bounds are checked on real work)."""
    calls = {case: ToolCallParser(JsonArrayFormat() if name == "json_array"
                                  else tool_call_format(name)).parse(text)[1]
             for case, (name, text) in TOOL_CASES.items()}
    assert {case for case, got in calls.items() if not got} == {
        "pythonic-unclosed", "qwen25-unclosed-name", "plain-text", "gpt-oss-text",
        "gpt-oss-nested",
        "pythonic-nested",
        "pythonic-nested-strings", "qwen25-nested", "llama3-nested", "mistral-nested"}
    assert len(calls["qwen25-many-calls"]) > 1000 and len(calls["llama3-many-calls"]) > 1000
    assert len(calls["mistral-many-calls"]) > 1000
    assert json.loads(calls["qwen25"][0].arguments)["notes"] == ["a", {"b": 'c" ]} x'}, 1]
    reasoning, content = ReasoningParser("qwen3").parse(REASONING_CASES["qwen3"][2])
    assert len(reasoning) > N - 100 and content == "Answer."
