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
    RegionParse,
    ToolCallFormat,
    read_call_object,
    skip_ws,
)

BEGIN, END = "<tool_call>", "</tool_call>"


class HermesFormat(ToolCallFormat):
    name = "qwen25"
    triggers = (BEGIN,)

    def parse_region(self, text: str, final: bool) -> RegionParse:
        start = skip_ws(text, len(BEGIN))
        call, end = read_call_object(text, start, final)
        if call is None:
            return NOT_A_CALL
        if end is None:
            return RegionParse([call])
        close = skip_ws(text, end)
        if text.startswith(END, close):
            return RegionParse([call], end=close + len(END))
        if END.startswith(text[close:]) and not final:
            return RegionParse([call])
        if final and close >= len(text):  # the model stopped before the closing tag
            return RegionParse([call], end=close)
        return NOT_A_CALL

    def structure(self, name: str) -> tuple[str, str]:
        return f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ', "}\n" + END
