"""Mistral (SGLang's ``mistral``)::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

and the newer form, one call after each marker: ``[TOOL_CALLS]get_weather[ARGS]{...}``.
``[TOOL_CALLS]`` is a special token in Mistral's tokenizers: the detokenizer keeps it.
"""

from __future__ import annotations

import json
import re

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    CallObject,
    JsonValue,
    PartialCall,
    Region,
    RegionParse,
    ToolCallFormat,
)
from radixlm.runtime.entrypoints.openai.function_call.scan import Run, TextMemo, TrailingSpace

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class CallArray:
    """``[{call}, {call}]`` at ``start`` of a growing text, read on from the last whole
    call; ``end`` an index of the text."""

    def __init__(self, start: int, memo: TextMemo) -> None:
        self.start, self.memo = start, memo
        self.calls: list[PartialCall] = []
        self.lead: Run | None = None
        self.obj: CallObject | None = None
        self.after: Run | None = None

    def parse(self, text: str, final: bool) -> RegionParse:
        if self.start >= len(text):
            return NOT_A_CALL if final else RegionParse()
        if text[self.start] != "[":
            return NOT_A_CALL
        self.lead = self.lead or Run(self.start + 1)
        while True:
            if self.obj is None:
                i = self.lead.skip(text)
                if i >= len(text):
                    return NOT_A_CALL if final else RegionParse(self.calls)
                if text[i] == "]" and not self.calls:
                    return NOT_A_CALL
                self.obj = CallObject(i, self.memo)
            call, end = self.obj.read(text, final)
            if call is None:
                return NOT_A_CALL
            if end is None:
                return RegionParse(self.calls, open_call=call)
            if self.after is None:
                self.calls.append(call)
                self.after = Run(end)
            j = self.after.skip(text)
            if j >= len(text):
                return NOT_A_CALL if final else RegionParse(self.calls)
            if text[j] == "]":
                return RegionParse(self.calls, end=j + 1)
            if text[j] != ",":
                return NOT_A_CALL
            self.lead, self.obj, self.after = Run(j + 1), None, None


class MistralRegion(Region):
    """The array form, or the compact ``[TOOL_CALLS]name[ARGS]{...}``."""

    def __init__(self, text: str, start: int, memo: TextMemo) -> None:
        super().__init__(text, start, memo)
        self.lead = Run(start + len(BOT))
        self.array: CallArray | None = None
        self.name_run: Run | None = None
        self.name = ""
        self.args: JsonValue | None = None
        self.tail: TrailingSpace | None = None

    def parse(self, text: str, final: bool) -> RegionParse:
        i = self.lead.skip(text)
        if i >= len(text):
            return NOT_A_CALL if final else RegionParse()
        if text[i] != "[":
            return self._compact(text, i, final)
        self.array = self.array or CallArray(i, self.memo)
        return self.array.parse(text, final)

    def _compact(self, text: str, i: int, final: bool) -> RegionParse:
        self.name_run = self.name_run or Run(i, _NAME)
        name_end = self.name_run.skip(text)
        if name_end == i:
            return NOT_A_CALL
        if name_end >= len(text):
            return NOT_A_CALL if final else RegionParse()
        if not text.startswith(ARGS, name_end):
            more = len(text) - name_end < len(ARGS) and ARGS.startswith(text[name_end:])
            return RegionParse() if more and not final else NOT_A_CALL
        start = name_end + len(ARGS)
        if self.args is None:
            self.args, self.tail = JsonValue(start, self.memo), TrailingSpace(start)
            self.name = text[i:name_end]
        end = self.args.end_of(text, final)
        name = self.name
        if end is None:
            if final:
                return NOT_A_CALL
            span = (start, self.tail.rstrip_end(text, len(text)))
            return RegionParse(open_call=PartialCall(name, span=span))
        return RegionParse([PartialCall(name, text[start:end], done=True)], end=end)


class MistralFormat(ToolCallFormat):
    name = "mistral"
    triggers = (BOT,)
    needs_special_tokens = True

    def region(self, text: str, start: int, memo: TextMemo) -> Region:
        return MistralRegion(text, start, memo)

    def structure(self, name: str) -> tuple[str, str]:
        return f'{BOT} [{{"name": {json.dumps(name)}, "arguments": ', "}]"
