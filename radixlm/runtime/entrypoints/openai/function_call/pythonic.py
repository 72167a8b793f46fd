"""Pythonic tool calls (SGLang's ``pythonic``: Llama 3.2 / 4, some Gemma fine-tunes)::

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

optionally between ``<|python_start|>`` and ``<|python_end|>``. Arguments are Python
literals; they are given to the client as JSON. A call is read when its list closes
(its brackets, counted as the text grows, balance).
"""

from __future__ import annotations

import ast
import json
import re

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    PartialCall,
    Region,
    RegionParse,
    ToolCallFormat,
)
from radixlm.runtime.entrypoints.openai.function_call.scan import PYTHON, Nesting, Run, TextMemo

START, END = "<|python_start|>", "<|python_end|>"
_NAME_START = re.compile(r"[A-Za-z_]")
_NAME_REST = re.compile(r"[\w.]*")


def _literal(node: ast.expr) -> object:
    value = ast.literal_eval(node)
    json.dumps(value)  # a tuple becomes a list; a set or bytes is not JSON: TypeError
    return value


def _calls(source: str) -> list[PartialCall] | None:
    """The calls of a whole ``[f(a=1), ...]`` list, or None if it is not one."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(
                node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(PartialCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False),
                                 done=True))
    return calls


class PythonicRegion(Region):
    """``[name(`` checked as it comes, then the list read when its brackets balance."""

    def __init__(self, text: str, start: int, memo: TextMemo) -> None:
        super().__init__(text, start, memo)
        self.tagged = text.startswith(START, start)
        self.lead = Run(start + len(START) if self.tagged else start)
        self.head: list[Run] = []  # after "[": spaces, the name, spaces before "("
        self.list: Nesting | None = None
        self.calls: list[PartialCall] | None = None
        self.rest: Run | None = None

    def parse(self, text: str, final: bool) -> RegionParse:
        b = self.lead.skip(text)
        if b >= len(text):
            return NOT_A_CALL if final else RegionParse()
        if self.list is None:
            opened = self._call_start(text, b)
            if opened is None:
                return NOT_A_CALL if final else RegionParse()
            if not opened:
                return NOT_A_CALL
            self.list = Nesting(b, PYTHON, self.memo)
        end = self.list.close(text)
        if end is None:
            return NOT_A_CALL if final else RegionParse()
        if self.calls is None:
            self.calls = _calls(text[b:end]) or []
        if not self.calls:
            return NOT_A_CALL
        if not self.tagged:
            return RegionParse(self.calls, end=end)
        self.rest = self.rest or Run(end)
        r = self.rest.skip(text)
        if text.startswith(END, r):
            return RegionParse(self.calls, end=r + len(END))
        if not final and len(text) - r < len(END) and END.startswith(text[r:]):
            return RegionParse(self.calls)
        return RegionParse(self.calls, end=end)

    def _call_start(self, text: str, b: int) -> bool | None:
        """Whether ``text[b:]`` opens a list of calls, ``[name(`` (None: not known yet)."""
        if text[b] != "[":
            return False
        if not self.head:
            self.head.append(Run(b + 1))
        i = self.head[0].skip(text)
        if len(self.head) == 1 and i < len(text):
            self.head.append(Run(i + 1, _NAME_REST) if _NAME_START.match(text[i]) else Run(i))
        if len(self.head) > 1:
            i = self.head[1].skip(text)
            if len(self.head) == 2 and i < len(text):
                self.head.append(Run(i))
            if len(self.head) > 2:
                i = self.head[2].skip(text)
        if i >= len(text):
            return None
        return text[i] == "("


class PythonicFormat(ToolCallFormat):
    name = "pythonic"
    triggers = (START, "[")
    needs_special_tokens = True

    def region(self, text: str, start: int, memo: TextMemo) -> Region:
        return PythonicRegion(text, start, memo)
