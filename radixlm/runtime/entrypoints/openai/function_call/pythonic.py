"""Pythonic tool calls (SGLang's ``pythonic``: Llama 3.2 / 4, some Gemma fine-tunes)::

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

optionally between ``<|python_start|>`` and ``<|python_end|>``. Arguments are Python
literals; they are given to the client as JSON. A call is read when its list closes.
"""

from __future__ import annotations

import ast
import json
import re

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    PartialCall,
    RegionParse,
    ToolCallFormat,
)

START, END = "<|python_start|>", "<|python_end|>"
_CALL_START = re.compile(r"\[\s*([A-Za-z_][\w.]*)?(\s*\()?")


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


def _list_end(text: str) -> int | None:
    """Index after the ``]`` that closes the list at ``text[0]`` (strings skipped)."""
    depth, quote, i = 0, "", 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class PythonicFormat(ToolCallFormat):
    name = "pythonic"
    triggers = (START, "[")
    needs_special_tokens = True

    def parse_region(self, text: str, final: bool) -> RegionParse:
        offset = len(START) if text.startswith(START) else 0
        body = text[offset:].lstrip()
        offset = len(text) - len(body)
        m = _CALL_START.match(body)
        if body and (m is None or (m.end() < len(body) and not m.group(2))):
            return NOT_A_CALL
        end = _list_end(body)
        if end is None:
            return NOT_A_CALL if final else RegionParse()
        calls = _calls(body[:end])
        if calls is None:
            return NOT_A_CALL
        end += offset
        rest = text[end:].lstrip()
        if text.startswith(START) and rest.startswith(END):
            end = len(text) - len(rest) + len(END)
        elif text.startswith(START) and not final and END.startswith(rest):
            return RegionParse(calls)
        return RegionParse(calls, end=end)
