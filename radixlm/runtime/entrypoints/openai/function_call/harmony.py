"""gpt-oss's harmony messages (SGLang's ``gpt-oss``)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>
    <|channel|>final<|message|>It is sunny.<|return|>

Each message is a region: a header up to ``<|message|>`` and a body up to ``<|end|>``,
``<|call|>`` or ``<|return|>``. A header naming ``to=functions.NAME`` makes the body a
call's JSON arguments; any other body (final, commentary preamble, analysis when no
reasoning parser took it) is ordinary text. The markers are special tokens: the
detokenizer keeps them.
"""

from __future__ import annotations

import re

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    PartialCall,
    RegionParse,
    ToolCallFormat,
    json_value_end,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_HEADER_MAX = 512


def _body_end(text: str, i: int) -> tuple[int, int] | None:
    """(end of the body, end of its end marker) from ``i``, or None if still open."""
    found = [(j, m) for m in ENDS if (j := text.find(m, i)) >= 0]
    if not found:
        return None
    j, m = min(found)
    return j, j + len(m)


def _held(body: str) -> str:
    """A partial body without a trailing piece of an end marker."""
    for k in range(min(len(body), max(map(len, ENDS)) - 1), 0, -1):
        if any(m.startswith(body[-k:]) for m in ENDS):
            return body[:-k]
    return body


class HarmonyFormat(ToolCallFormat):
    name = "gpt-oss"
    triggers = (START, CHANNEL)
    needs_special_tokens = True

    def parse_region(self, text: str, final: bool) -> RegionParse:
        head_end = text.find(MESSAGE)
        if head_end < 0:
            if final or len(text) > _HEADER_MAX:
                return NOT_A_CALL
            return RegionParse()
        header, start = text[:head_end], head_end + len(MESSAGE)
        done = _body_end(text, start)
        body = text[start:done[0]] if done else text[start:]
        m = _RECIPIENT.search(header)
        if m is None:  # ordinary text: stream it as it comes
            if done is None:
                return RegionParse(text=body) if final else RegionParse(text=_held(body))
            return RegionParse(text=body, end=done[1])
        name = m.group(1)
        if done is None and final:
            done = (len(text), len(text))
        if done is None:
            return RegionParse([PartialCall(name, _held(body).strip())])
        args = body.strip()
        if json_value_end(args, 0) != len(args):
            return NOT_A_CALL if final else RegionParse([PartialCall(name, args)])
        return RegionParse([PartialCall(name, args, done=True)], end=done[1])
