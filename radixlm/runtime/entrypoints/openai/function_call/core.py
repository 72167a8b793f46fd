"""What every tool-call format shares: the calls it finds, and the format interface.

A format (one module each: hermes.py, llama3.py, mistral.py, pythonic.py, harmony.py,
json_array.py) says where calls start in the model's text (``triggers``) and how to read
the region from a trigger on (``region``), complete or cut short; the region reads the
text again as it grows, going on from where it stopped (scan.py). The streaming and
non-streaming paths both run ``driver.ToolCallParser`` over it, so a stream's deltas always
add up to what the whole text parses to.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.entrypoints.openai.function_call.scan import (
    Nesting,
    Run,
    TextMemo,
    TrailingSpace,
)

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_NAME_STOP = re.compile(r'["\\]')
_TOKEN = re.compile(r"[A-Za-z0-9.+\-]*")  # a JSON number or literal (NaN, -Infinity...)


@dataclass
class PartialCall:
    """A call read so far: ``arguments`` is a prefix of its final arguments text (the
    whole of it once ``done``); ``name`` is None until it is known. An open call's
    arguments may instead be ``span``, a slice of the text read (not copied at each delta)."""

    name: str | None
    arguments: str = ""
    done: bool = False
    span: tuple[int, int] | None = None

    def args_length(self) -> int:
        return len(self.arguments) if self.span is None else self.span[1] - self.span[0]

    def args_from(self, text: str, i: int) -> str:
        """The arguments from their ``i``-th character on."""
        if self.span is None:
            return self.arguments[i:]
        return text[self.span[0] + i:self.span[1]]


@dataclass
class RegionParse:
    """The calls found from a trigger on; ``end`` is where the call region stops (an index
    of the text; text after it is ordinary text again), None while the region is
    unfinished; a region that ends before the output does stays so. ``text``: the span of
    ordinary text inside the region (harmony's final channel), only ever extended.
    ``open_call``: the call still being read, after ``calls``."""

    calls: list[PartialCall] = field(default_factory=list)
    end: int | None = None
    text: tuple[int, int] | None = None
    open_call: PartialCall | None = None


NOT_A_CALL = RegionParse(end=-1)  # the text at the trigger cannot be a call


@dataclass(frozen=True)
class ToolCall:
    """One finished call, as OpenAI's ``tool_calls`` entry gives it."""

    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Region(abc.ABC):
    """One call region of a growing text, from its trigger at ``start`` on. ``parse`` reads
    it again each time the text has grown, going on from where it stopped: a stream of n
    characters costs O(n) however it is cut into deltas."""

    def __init__(self, text: str, start: int, memo: TextMemo) -> None:
        """``memo``: shared by the regions of one text."""
        self.start, self.memo = start, memo

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> RegionParse:
        """The region of ``text`` (the text given before, grown). ``final``: the output is
        complete, so an unfinished call is not a call. ``NOT_A_CALL`` when the text is not
        (and cannot become) a call region."""


class ToolCallFormat(abc.ABC):
    """How one model family writes tool calls."""

    name = ""
    triggers: tuple[str, ...] = ()
    # special tokens the format is written with: the detokenizer must keep them
    needs_special_tokens = False

    @abc.abstractmethod
    def region(self, text: str, start: int, memo: TextMemo) -> Region:
        """A reader of the call region at ``text[start]``, which starts with one of
        ``triggers``."""

    def structure(self, name: str) -> tuple[str, str] | None:
        """(begin, end) around the arguments JSON of a call of ``name``, for the
        ``structural_tag`` grammar of ``tool_choice: "auto"``; None if the format's calls
        are not JSON arguments between fixed strings."""
        return None


# --- JSON helpers -------------------------------------------------------------------------------
def json_value_end(text: str, i: int, stop: int) -> int | None:
    """End of the JSON value at ``text[i:stop]``, or None if it is not a whole value there.
    (Decoded from a copy of that span: a decoding error counts the lines of all the text it
    is given, which at each of many values would be quadratic.)"""
    try:
        return i + _DECODER.raw_decode(text[i:stop])[1]
    except (ValueError, RecursionError):  # ValueError: also an integer of 4,300+ digits
        return None


class JsonValue:
    """The JSON value at ``start`` of a growing text: its end, found by scanning each new
    character once and decoding the value once, when it can be whole (its bracket or quote
    closes; a number or literal is followed by another character, or the output ends)."""

    def __init__(self, start: int, memo: TextMemo) -> None:
        self.start, self.memo = start, memo
        self.scan: Nesting | Run | None = None
        self.end: int | None = None
        self.dead = False  # decoded when it closed, and is not JSON: it never ends

    def end_of(self, text: str, final: bool) -> int | None:
        if self.end is not None or self.dead or self.start >= len(text):
            return self.end
        if self.scan is None:
            self.scan = (Nesting(self.start, memo=self.memo) if text[self.start] in '{["'
                         else Run(self.start, _TOKEN))
        if isinstance(self.scan, Nesting):
            stop = self.scan.close(text)
        else:
            stop = self.scan.skip(text)
            stop = stop if stop < len(text) or final else None
        if stop is not None:  # the value can only be text[start:stop], or a prefix of it
            self.end = json_value_end(text, self.start, stop)
            self.dead = self.end is None
        return self.end


class _Header:
    """``{"name": "NAME", "arguments":`` (or ``"parameters"``) at ``start``, whitespace
    between, matched as the text grows; NAME as the regex ``(?:[^"\\]|\\.)*`` takes it.
    ``advance``: True once matched (``name``, and ``pos`` after the colon), None while the
    text may still match, False when it cannot."""

    STEPS = ("{", None, '"name"', None, ":", None, '"', "NAME", None, ",", None,
             ('"arguments"', '"parameters"'), None, ":")

    def __init__(self, start: int) -> None:
        self.step, self.pos, self.name_at = 0, start, start
        self.name: str | None = None
        self.state: bool | None = None

    def advance(self, text: str) -> bool | None:
        while self.state is None and self.step < len(self.STEPS):
            want = self.STEPS[self.step]
            if want is None:
                self.pos = _WS.match(text, self.pos).end()
                if self.pos >= len(text):
                    return None
            elif want == "NAME":
                m = _NAME_STOP.search(text, self.pos)
                if m is None or (m.group() == "\\" and m.end() == len(text)):
                    self.pos = len(text) if m is None else m.start()
                    return None
                if m.group() == "\\":  # an escape; the regex's "." takes no newline
                    self.state = False if text[m.end()] == "\n" else None
                    self.pos = m.end() + 1
                    continue
                self.name, self.pos = text[self.name_at:m.start()], m.end()
            else:
                options = want if isinstance(want, tuple) else (want,)
                rest = text[self.pos:self.pos + max(map(len, options))]
                hit = next((o for o in options if rest.startswith(o)), None)
                if hit is None:
                    if self.pos + len(rest) == len(text) and any(o.startswith(rest)
                                                                 for o in options):
                        return None
                    self.state = False
                    break
                self.pos += len(hit)
                self.name_at = self.pos
            self.step += 1
        if self.state is None:
            self.state = True
        return self.state


class CallObject:
    """One ``{"name": ..., "arguments"|"parameters": {...}}`` object at ``start`` of a
    growing text. ``read`` gives the call (partial while unfinished) and the object's end
    (None while unfinished); (None, None): not a call object. With the name first (how
    models and our grammars write it) the arguments stream as they come; other key orders
    give the call when the object is complete."""

    def __init__(self, start: int, memo: TextMemo) -> None:
        self.start, self.memo = start, memo
        self.header = _Header(start)
        self.name: str | None = None
        self.args_at: Run | None = None
        self.args: JsonValue | None = None
        self.tail: TrailingSpace | None = None
        self.args_text = ""
        self.close: Run | None = None
        self.whole: JsonValue | None = None
        self.outcome: tuple[PartialCall | None, int | None] | None = None

    def read(self, text: str, final: bool) -> tuple[PartialCall | None, int | None]:
        if self.outcome is not None:
            return self.outcome
        matched = self.header.advance(text) if self.name is None else True
        if matched and self.name is None:
            try:
                self.name = json.loads(f'"{self.header.name}"')
            except json.JSONDecodeError:
                matched = self.header.state = False
        if matched is False:
            return self._other_order(text, final)
        if matched is None:  # still maybe name-first, so the object is still open
            return (None, None) if final else (PartialCall(None), None)
        return self._name_first(text, final)

    def _settle(self, call: PartialCall | None, end: int | None) -> tuple:
        self.outcome = (call, end)
        return self.outcome

    def _name_first(self, text: str, final: bool) -> tuple[PartialCall | None, int | None]:
        self.args_at = self.args_at or Run(self.header.pos)
        start = self.args_at.skip(text)
        if start >= len(text):
            return (None, None) if final else (PartialCall(self.name), None)
        if text[start] != "{":  # only an object can be the arguments
            return self._settle(None, None)
        if self.args is None:
            self.args, self.tail = JsonValue(start, self.memo), TrailingSpace(start)
        end = self.args.end_of(text, final)
        if end is None:
            if final:
                return None, None
            span = (start, self.tail.rstrip_end(text, len(text)))
            return PartialCall(self.name, span=span), None
        if self.close is None:
            self.args_text, self.close = text[start:end], Run(end)
        close = self.close.skip(text)
        if close >= len(text):
            return (None, None) if final else (PartialCall(self.name, self.args_text), None)
        if text[close] != "}":
            return self._settle(None, None)
        return self._settle(PartialCall(self.name, self.args_text, done=True), close + 1)

    def _other_order(self, text: str, final: bool) -> tuple[PartialCall | None, int | None]:
        if text[self.start] != "{":
            return self._settle(None, None)
        self.whole = self.whole or JsonValue(self.start, self.memo)
        end = self.whole.end_of(text, final)
        if end is None:
            return (None, None) if final else (PartialCall(None), None)
        obj = json.loads(text[self.start:end])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return self._settle(None, None)
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _loads_or(args, None)
        if not isinstance(args, dict):
            return self._settle(None, None)
        call = PartialCall(obj["name"], json.dumps(args, ensure_ascii=False), done=True)
        return self._settle(call, end)


def _loads_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default
