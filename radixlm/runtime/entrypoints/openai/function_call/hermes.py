"""Hermes / Qwen 2.5 / Qwen 3 (SGLang's ``qwen25``, ``qwen``; vLLM's ``hermes``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, any number of blocks, ordinary text around them.
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

BEGIN, END = "<tool_call>", "</tool_call>"


class HermesRegion(Region):
    def __init__(self, text: str, start: int, memo: TextMemo) -> None:
        super().__init__(text, start, memo)
        self.lead = Run(start + len(BEGIN))
        self.obj: CallObject | None = None
        self.close: Run | None = None

    def parse(self, text: str, final: bool) -> RegionParse:
        i = self.lead.skip(text)
        if i >= len(text):
            return NOT_A_CALL if final else RegionParse([PartialCall(None)])
        self.obj = self.obj or CallObject(i, self.memo)
        call, end = self.obj.read(text, final)
        if call is None:
            return NOT_A_CALL
        if end is None:
            return RegionParse(open_call=call)
        self.close = self.close or Run(end)
        close = self.close.skip(text)
        if text.startswith(END, close):
            return RegionParse([call], end=close + len(END))
        if not final and len(text) - close < len(END) and END.startswith(text[close:]):
            return RegionParse([call])
        if final and close >= len(text):  # the model stopped before the closing tag
            return RegionParse([call], end=close)
        return NOT_A_CALL


class HermesFormat(ToolCallFormat):
    name = "qwen25"
    triggers = (BEGIN,)

    def region(self, text: str, start: int, memo: TextMemo) -> Region:
        return HermesRegion(text, start, memo)

    def structure(self, name: str) -> tuple[str, str]:
        return f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ', "}\n" + END
