"""gpt-oss's harmony messages (SGLang's ``gpt-oss``)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>
    <|channel|>final<|message|>It is sunny.<|return|>

Each message is a region: a header up to ``<|message|>`` and a body up to ``<|end|>``,
``<|call|>`` or ``<|return|>``. A header naming ``to=functions.NAME`` makes the body a
call's JSON arguments; any other body (final, commentary preamble, analysis when no
reasoning parser took it) is ordinary text. A header is at most 512 characters. The
markers are special tokens: the detokenizer keeps them.
"""

from __future__ import annotations

import re

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    JsonValue,
    PartialCall,
    Region,
    RegionParse,
    ToolCallFormat,
)
from radixlm.runtime.entrypoints.openai.function_call.scan import (
    Finder,
    Run,
    TextMemo,
    TrailingSpace,
    held,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_HEADER_MAX = 512


class HarmonyRegion(Region):
    """A header (at most ``_HEADER_MAX`` characters) up to ``<|message|>``, then a body
    whose end markers are looked for in the new text only."""

    def __init__(self, text: str, start: int, memo: TextMemo) -> None:
        super().__init__(text, start, memo)
        self.header = Finder(MESSAGE, start, stop=start + _HEADER_MAX + len(MESSAGE))
        self.body = -1  # where the body starts, once the header is whole
        self.name: str | None = None
        self.lead: Run | None = None
        self.tail: TrailingSpace | None = None
        self.valid: bool | None = None  # the arguments, once the body ended

    def parse(self, text: str, final: bool) -> RegionParse:
        if self.body < 0:
            head_end = self.header.find(text)
            if head_end < 0:
                if final or len(text) - self.start > _HEADER_MAX:
                    return NOT_A_CALL
                return RegionParse()
            self.body = head_end + len(MESSAGE)
            m = _RECIPIENT.search(text, self.start, head_end)
            self.name = None if m is None else m.group(1)
            self.lead, self.tail = Run(self.body), TrailingSpace(self.body)
        found = [(j, j + len(e)) for e in ENDS if (j := self.memo.find(text, e, self.body)) >= 0]
        done = min(found, default=None)
        if self.name is None:  # ordinary text: stream it as it comes
            if done is not None:
                return RegionParse(text=(self.body, done[0]), end=done[1])
            stop = len(text) if final else len(text) - held(text, self.body, ENDS)
            return RegionParse(text=(self.body, stop))
        if done is None and final:
            done = (len(text), len(text))
        if done is None:
            stop = len(text) - held(text, self.body, ENDS)
            end = self.tail.rstrip_end(text, stop)
        else:  # read once for all the regions that end there (each tried at the end)
            stop = done[0]
            end = max(self.body, self.memo.rstrip_end(text, stop))
        lead = min(self.lead.skip(text), stop)
        args = (lead, max(lead, end))
        if done is not None and self.valid is None:  # (regions ending here share the scan)
            self.valid = JsonValue(args[0], self.memo).end_of(text, True) == args[1]
        if self.valid:
            call = PartialCall(self.name, text[args[0]:args[1]], done=True)
            return RegionParse([call], end=done[1])
        if final:
            return NOT_A_CALL
        return RegionParse(open_call=PartialCall(self.name, span=args))


class HarmonyFormat(ToolCallFormat):
    name = "gpt-oss"
    triggers = (START, CHANNEL)
    needs_special_tokens = True

    def region(self, text: str, start: int, memo: TextMemo) -> Region:
        return HarmonyRegion(text, start, memo)
