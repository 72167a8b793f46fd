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
    CallObject,
    PartialCall,
    Region,
    RegionParse,
    ToolCallFormat,
)
from radixlm.runtime.entrypoints.openai.function_call.scan import Run, TextMemo

PYTHON_TAG = "<|python_tag|>"


class Llama3Region(Region):
    """Calls separated by ``;``, each maybe after a tag; read on from the last whole one."""

    def __init__(self, text: str, start: int, memo: TextMemo) -> None:
        super().__init__(text, start, memo)
        tagged = text.startswith(PYTHON_TAG, start)
        self.calls: list[PartialCall] = []
        self._next(start + len(PYTHON_TAG) if tagged else start)

    def _next(self, i: int) -> None:
        self.lead, self.tag, self.obj, self.after = Run(i), None, None, None

    def parse(self, text: str, final: bool) -> RegionParse:
        while True:
            if self.obj is None:
                i = self.lead.skip(text)
                if text.startswith(PYTHON_TAG, i):
                    self.tag = self.tag or Run(i + len(PYTHON_TAG))
                    i = self.tag.skip(text)
                elif not final and len(text) - i < len(PYTHON_TAG) and PYTHON_TAG.startswith(
                        text[i:]):
                    return RegionParse(self.calls)  # may still be a tag, or a call
                if i >= len(text):
                    if not final:
                        return RegionParse(self.calls)
                    return RegionParse(self.calls, end=i) if self.calls else NOT_A_CALL
                self.obj = CallObject(i, self.memo)
            call, end = self.obj.read(text, final)
            if call is None:
                return RegionParse(self.calls, end=self.obj.start) if self.calls else NOT_A_CALL
            if end is None:
                return RegionParse(self.calls, open_call=call)
            if self.after is None:
                self.calls.append(call)
                self.after = Run(end)
            j = self.after.skip(text)
            if j >= len(text):
                return RegionParse(self.calls, end=end if final else None)
            if text[j] != ";":
                return RegionParse(self.calls, end=end)
            self._next(j + 1)


class Llama3Format(ToolCallFormat):
    name = "llama3"
    triggers = (PYTHON_TAG, '{"name"')
    needs_special_tokens = True

    def region(self, text: str, start: int, memo: TextMemo) -> Region:
        return Llama3Region(text, start, memo)

    def structure(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "parameters": ', "}"
