"""What every tool-call format shares: the calls it finds, and the format interface.

A format (one module each: hermes.py, llama3.py, mistral.py, pythonic.py, harmony.py,
json_array.py) says where calls start in the model's text (``triggers``) and how to read
the region from a trigger on (``parse_region``), complete or cut short. The streaming and
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

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


@dataclass
class PartialCall:
    """A call read so far: ``arguments`` is a prefix of its final arguments text (the
    whole of it once ``done``); ``name`` is None until it is known."""

    name: str | None
    arguments: str = ""
    done: bool = False


@dataclass
class RegionParse:
    """The calls found from a trigger on; ``end`` is where the call region stops (text
    after it is ordinary text again), None while the region is unfinished. ``text``:
    ordinary text inside the region (harmony's final channel), only ever extended."""

    calls: list[PartialCall] = field(default_factory=list)
    end: int | None = None
    text: str = ""


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


class ToolCallFormat(abc.ABC):
    """How one model family writes tool calls."""

    name = ""
    triggers: tuple[str, ...] = ()
    # special tokens the format is written with: the detokenizer must keep them
    needs_special_tokens = False

    @abc.abstractmethod
    def parse_region(self, text: str, final: bool) -> RegionParse:
        """Read calls from ``text``, which starts with one of ``triggers``. ``final``: the
        output is complete, so an unfinished call is not a call. ``NOT_A_CALL`` when the
        text is not (and cannot become) a call region."""

    def structure(self, name: str) -> tuple[str, str] | None:
        """(begin, end) around the arguments JSON of a call of ``name``, for the
        ``structural_tag`` grammar of ``tool_choice: "auto"``; None if the format's calls
        are not JSON arguments between fixed strings."""
        return None


# --- JSON helpers -------------------------------------------------------------------------------
def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def json_value_end(text: str, i: int) -> int | None:
    """End of the JSON value at ``text[i:]``, or None if it is not (yet) a whole value."""
    try:
        return _DECODER.raw_decode(text, i)[1]
    except (json.JSONDecodeError, RecursionError):
        return None


def could_be_json_prefix(text: str) -> bool:
    """Whether ``text`` may still grow into JSON (cheap check of the first character)."""
    s = text.lstrip()
    return not s or s[0] in '{["-0123456789tfn'


_NAME_FIRST = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def read_call_object(text: str, i: int, final: bool) -> tuple[PartialCall | None, int | None]:
    """A ``{"name": ..., "arguments"|"parameters": {...}}`` object at ``text[i:]``: the
    call (partial while unfinished) and the object's end (None while unfinished). With
    the name first (how models and our grammars write it) arguments stream as they come;
    other key orders give the call when the object is complete. (None, None): not a call
    object."""
    m = _NAME_FIRST.match(text, i)
    if m is not None:
        name = json.loads(f'"{m.group(1)}"')
        start = m.end()
        args_end = json_value_end(text, start)
        if args_end is None:
            if final:
                return None, None
            return PartialCall(name, text[start:].rstrip()), None
        args = text[start:args_end]
        close = skip_ws(text, args_end)
        if close >= len(text):
            return (None, None) if final else (PartialCall(name, args), None)
        if text[close] != "}" or not _is_object(args):
            return None, None
        return PartialCall(name, args, done=True), close + 1
    end = json_value_end(text, i)
    if end is None:
        if final or not could_be_json_prefix(text[i:]) or text[i:i + 1] not in ("", "{"):
            return None, None
        return PartialCall(None), None
    obj = json.loads(text[i:end])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads_or(args, None)
    if not isinstance(args, dict):
        return None, None
    return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False), done=True), end


def _is_object(text: str) -> bool:
    return isinstance(_loads_or(text, None), dict)


def _loads_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return default
