"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (SGLang's ``llama3``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The ``<|python_tag|>`` is optional (and a special token, which the detokenizer must keep);
several calls are separated by ``;``. Without the tag, a call is a JSON object that starts
the output's text where a ``{"name"`` appears.
"""

from __future__ import annotations

import json

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    RegionParse,
    ToolCallFormat,
    read_call_object,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Format(ToolCallFormat):
    name = "llama3"
    triggers = (PYTHON_TAG, '{"name"')
    needs_special_tokens = True

    def parse_region(self, text: str, final: bool) -> RegionParse:
        i = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        calls = []
        while True:
            i = skip_ws(text, i)
            if text.startswith(PYTHON_TAG, i):
                i = skip_ws(text, i + len(PYTHON_TAG))
            call, end = read_call_object(text, i, final)
            if call is None:
                return RegionParse(calls, end=i) if calls else NOT_A_CALL
            calls.append(call)
            if end is None:
                return RegionParse(calls)
            j = skip_ws(text, end)
            if j >= len(text):
                return RegionParse(calls, end=end if final else None)
            if text[j] != ";":
                return RegionParse(calls, end=end)
            i = j + 1

    def structure(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "parameters": ', "}"
