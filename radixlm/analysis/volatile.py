"""Why two prompts stop sharing a prefix: the volatile span at the first differing character.

``classify(a, b, p)`` looks at the two texts around ``p`` (``a[:p] == b[:p]``, ``a[p] !=
b[p]``) and names the cause: a JSON object whose keys come in another order, a timestamp
or date, a UUID, a hex or random id, a number, a whitespace difference; ``content`` when
the texts simply differ there (a user's question: nothing to fix). ``apply_fix`` rewrites
both prompts as a caller could: volatile values moved to the end, JSON with sorted keys,
whitespace collapsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_DAY = r"(?:(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day,? )?"
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
          r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_TIME = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?: ?[AaPp][Mm])?"
_ZONE = r"(?:Z|[+-]\d{2}:?\d{2}|(?: [A-Z]{2,5}))?"
TIMESTAMP = re.compile("|".join([
    rf"\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]{_TIME}{_ZONE})?",  # ISO 8601
    rf"\d{{1,2}}/\d{{1,2}}/\d{{2,4}}(?:,? {_TIME})?",
    rf"{_DAY}{_MONTH}\.? \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}(?:,? {_TIME}{_ZONE})?",
    rf"{_DAY}\d{{1,2}} {_MONTH} \d{{4}}(?:,? {_TIME}{_ZONE})?",  # RFC 2822
    rf"{_TIME}{_ZONE}",
    r"(?<!\d)1[5-9]\d{8}(?:\d{3})?(?!\d)",  # Unix seconds or milliseconds
]))
UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
HEX_ID = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])"
                    r"[0-9a-fA-F]{8,}(?![0-9A-Za-z])")
RANDOM_ID = re.compile(r"(?<![0-9A-Za-z])(?=[0-9A-Za-z]*\d)(?=[0-9A-Za-z]*[A-Za-z])"
                       r"[0-9A-Za-z]{12,}(?![0-9A-Za-z])")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
PATTERNS = (("timestamp", TIMESTAMP), ("uuid", UUID), ("hex_id", HEX_ID),
            ("random_id", RANDOM_ID), ("number", NUMBER))
MOVABLE = {name for name, _ in PATTERNS}
WINDOW = 120  # characters searched on each side of the divergence for a volatile value
JSON_LOOKBACK = 4000  # characters searched back for the opening brace of a JSON object
FIXES = {
    "timestamp": "move the timestamp/date to the end of the prompt (or round it)",
    "uuid": "move the UUID to the end of the prompt",
    "hex_id": "move the hex id to the end of the prompt",
    "random_id": "move the random id to the end of the prompt",
    "number": "move the changing number to the end of the prompt",
    "json_key_order": "serialize JSON with sorted keys (json.dumps(..., sort_keys=True))",
    "whitespace": "normalize whitespace (strip trailing spaces, one newline style)",
    "content": "none: the prompts differ in content here (the unshared part)",
}


@dataclass(frozen=True)
class Cause:
    """Why ``a`` and ``b`` diverge; the spans are ``[start, end)`` in each text."""

    kind: str
    span_a: tuple[int, int]
    span_b: tuple[int, int]

    @property
    def start(self) -> int:
        """Where the stable prefix ends: the start of the volatile span."""
        return min(self.span_a[0], self.span_b[0])


def common_prefix(a: str | list[int], b: str | list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    step = 64
    while i < n and a[i:i + step] == b[i:i + step]:  # long equal runs go fast
        i += step
    i = min(i, n)  # every block before i is equal
    while i < n and a[i] == b[i]:
        i += 1
    return i


def classify(a: str, b: str, p: int) -> Cause:
    """The cause of divergence at ``p``; ``content`` when nothing volatile covers it."""
    for finder in (_json_reorder, _volatile_value, _whitespace):
        cause = finder(a, b, p)
        if cause is not None:
            return cause
    return Cause("content", (p, p), (p, p))


def _covering(pattern: re.Pattern[str], text: str, p: int) -> tuple[int, int] | None:
    """The match of ``pattern`` that starts at or before ``p`` and reaches it."""
    lo = max(p - WINDOW, 0)
    for m in pattern.finditer(text, lo, min(p + WINDOW, len(text))):
        if m.start() <= p < m.end() or m.start() < p == m.end():
            return m.start(), m.end()
        if m.start() > p:
            break
    return None


def _volatile_value(a: str, b: str, p: int) -> Cause | None:
    for kind, pattern in PATTERNS:
        sa, sb = _covering(pattern, a, p), _covering(pattern, b, p)
        if sa is not None and sb is not None and (sa[1] > p or sb[1] > p):
            return Cause(kind, sa, sb)
    return None


def _json_reorder(a: str, b: str, p: int) -> Cause | None:
    """Innermost JSON object around ``p`` that parses in both texts: equal objects with
    different text are reordered keys (or whitespace); unequal ones stop the search."""
    decoder = json.JSONDecoder()
    start = p
    while True:
        start = a.rfind("{", max(p - JSON_LOOKBACK, 0), start)
        if start < 0:
            return None
        try:
            obj_a, end_a = decoder.raw_decode(a, start)
            obj_b, end_b = decoder.raw_decode(b, start)
        except ValueError:
            continue
        if end_a <= p or end_b <= p:
            continue  # an object that closes before the divergence
        if obj_a != obj_b:
            return None
        same_ws = re.sub(r"\s+", "", a[start:end_a]) == re.sub(r"\s+", "", b[start:end_b])
        kind = "whitespace" if same_ws else "json_key_order"
        return Cause(kind, (start, end_a), (start, end_b))


def _ws_run(text: str, p: int) -> tuple[int, int]:
    s = p
    while s > 0 and text[s - 1].isspace():
        s -= 1
    e = p
    while e < len(text) and text[e].isspace():
        e += 1
    return s, e


def _whitespace(a: str, b: str, p: int) -> Cause | None:
    at = (a[p:p + 1] + b[p:p + 1])
    if not any(c.isspace() for c in at):
        return None
    ra, rb = _ws_run(a, p), _ws_run(b, p)
    if a[ra[1]:ra[1] + 32] != b[rb[1]:rb[1] + 32]:
        return None
    return Cause("whitespace", ra, rb)


def apply_fix(cause: Cause, a: str, b: str) -> tuple[str, str, str | None]:
    """Both texts with the cause fixed, and the text moved to the end of ``b`` (None when
    nothing moved: JSON keys sorted, whitespace collapsed)."""
    (sa, ea), (sb, eb) = cause.span_a, cause.span_b
    if cause.kind in MOVABLE:
        return a[:sa] + a[ea:], b[:sb] + b[eb:], b[sb:eb]
    if cause.kind == "json_key_order":
        return (a[:sa] + _sorted_json(a[sa:ea]) + a[ea:],
                b[:sb] + _sorted_json(b[sb:eb]) + b[eb:], None)
    if cause.kind == "whitespace":
        return (a[:sa] + _collapse(a[sa:ea]) + a[ea:], b[:sb] + _collapse(b[sb:eb]) + b[eb:],
                None)
    raise ValueError(f"no fix for {cause.kind!r}")


def _sorted_json(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)


def _collapse(ws: str) -> str:
    if re.fullmatch(r"\s*", ws):
        return "\n" if "\n" in ws else (" " if ws else "")
    return re.sub(r"\s+", " ", ws)  # a JSON object whose whitespace differs


def context(text: str, start: int, end: int, width: int = 40) -> str:
    """``text`` around ``[start, end)``, the span in brackets, newlines shown as \\n."""
    left = text[max(start - width, 0):start]
    right = text[end:end + width]
    shown = f"{'...' if start > width else ''}{left}[{text[start:end]}]{right}"
    return shown.replace("\n", "\\n")
