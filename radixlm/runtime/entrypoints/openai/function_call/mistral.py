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
    PartialCall,
    RegionParse,
    ToolCallFormat,
    json_value_end,
    read_call_object,
    skip_ws,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_ARGS = re.compile(r"([A-Za-z0-9_.\-]+)(\[ARGS\])?")


def read_call_array(text: str, i: int, final: bool) -> RegionParse:
    """``[{call}, {call}]`` at ``text[i:]``; ``end`` relative to ``text``."""
    if i >= len(text):
        return NOT_A_CALL if final else RegionParse()
    if text[i] != "[":
        return NOT_A_CALL
    calls: list[PartialCall] = []
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return NOT_A_CALL if final else RegionParse(calls)
        if text[i] == "]" and not calls:
            return NOT_A_CALL
        call, end = read_call_object(text, i, final)
        if call is None:
            return NOT_A_CALL
        calls.append(call)
        if end is None:
            return RegionParse(calls)
        j = skip_ws(text, end)
        if j >= len(text):
            return NOT_A_CALL if final else RegionParse(calls)
        if text[j] == "]":
            return RegionParse(calls, end=j + 1)
        if text[j] != ",":
            return NOT_A_CALL
        i = j + 1


class MistralFormat(ToolCallFormat):
    name = "mistral"
    triggers = (BOT,)
    needs_special_tokens = True

    def parse_region(self, text: str, final: bool) -> RegionParse:
        i = skip_ws(text, len(BOT))
        if i < len(text) and text[i] != "[":
            return self._compact(text, i, final)
        return read_call_array(text, i, final)

    @staticmethod
    def _compact(text: str, i: int, final: bool) -> RegionParse:
        m = _NAME_ARGS.match(text, i)
        if m is None:
            return NOT_A_CALL
        if m.group(2) is None:
            return NOT_A_CALL if final or m.end() < len(text) else RegionParse()
        start = m.end()
        end = json_value_end(text, start)
        if end is None:
            return NOT_A_CALL if final else RegionParse([PartialCall(m.group(1),
                                                                     text[start:].rstrip())])
        return RegionParse([PartialCall(m.group(1), text[start:end], done=True)], end=end)

    def structure(self, name: str) -> tuple[str, str]:
        return f'{BOT} [{{"name": {json.dumps(name)}, "arguments": ', "}]"
