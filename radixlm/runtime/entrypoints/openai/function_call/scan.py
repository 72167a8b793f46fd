"""Resumable scans over a text that only grows: a streamed output, read delta by delta.

Each scan remembers where it stopped and goes on from there when the text has grown, so
reading an output of n characters, however it is cut into deltas, examines each character
a bounded number of times. That keeps every tool-call and reasoning parser linear in its
output: re-reading the whole text at each delta is quadratic, and a tenant can force a
long unclosed call (``tests/runtime/entrypoints/function_call/test_parser_cost.py``).
"""

from __future__ import annotations

import bisect
import re

_SPACES = re.compile(r"\s*")
JSON, PYTHON = ('"', "[]{}"), ("'\"", "[](){}")  # (quotes, bracket pairs) of a Nesting
_CODE = {q + b: re.compile("[" + re.escape(q + b) + "]") for q, b in (JSON, PYTHON)}
_QUOTED = {q: re.compile(r"[\\" + q + "]") for q in "'\""}


class Finder:
    """The first ``sub`` at or after ``start`` (ending by ``stop``); -1 while there is none."""

    __slots__ = ("sub", "next", "stop", "at")

    def __init__(self, sub: str, start: int, stop: int | None = None) -> None:
        self.sub, self.next, self.stop, self.at = sub, start, stop, -1

    def find(self, text: str) -> int:
        if self.at < 0:
            j = text.find(self.sub, self.next, self.stop)
            if j >= 0:
                self.at = j
            else:  # an occurrence may still straddle the end
                self.next = max(self.next, len(text) - len(self.sub) + 1)
        return self.at


class Run:
    """The end of the run of ``chars`` (a regex ``[...]*``; whitespace by default) from
    ``start``: settled once another character follows it."""

    __slots__ = ("chars", "end", "settled")

    def __init__(self, start: int, chars: re.Pattern[str] | None = None) -> None:
        self.chars, self.end, self.settled = chars or _SPACES, start, False

    def skip(self, text: str) -> int:
        if not self.settled:
            self.end = self.chars.match(text, self.end).end()
            self.settled = self.end < len(text)
        return self.end


class TrailingSpace:
    """``a + len(text[a:stop].rstrip())`` for a growing text and a ``stop`` that only grows,
    scanning each character once."""

    __slots__ = ("end", "scanned")

    def __init__(self, start: int) -> None:
        self.end = self.scanned = start

    def rstrip_end(self, text: str, stop: int) -> int:
        assert stop >= self.scanned, (stop, self.scanned)
        kept = len(text[self.scanned:stop].rstrip())
        if kept:
            self.end = self.scanned + kept
        self.scanned = stop
        return self.end


class TextMemo:
    """What the scans over one text found, shared by its regions: where the brackets that
    Nestings saw outside strings close, where markers are, where a span's trailing spaces
    start.

    When a call region is still open at the end of the output, each trigger inside it is
    tried in turn; each would otherwise scan to the end again (quadratic). A Nesting from a
    bracket an earlier one saw reads its answer here. Triggers inside the strings of such a
    region still need scans of their own, so all the Nestings of a text scan at most
    ``SCAN_BUDGET`` times its length: past that, a value not closed yet stays open (a call
    the output never finished)."""

    SCAN_BUDGET = 2

    def __init__(self) -> None:
        self.closes: dict[tuple[str, int], int] = {}  # -> the index after its closer
        self.open_in: dict[tuple[str, int], Nesting] = {}  # not closed yet, seen by it
        self.scanned = 0
        self.markers: dict[str, list[int]] = {}  # sub -> [from, places found..., next]
        self.stripped: dict[int, int] = {}  # stop -> len(text[:stop].rstrip())

    def may_scan(self, text: str) -> bool:
        return self.scanned <= self.SCAN_BUDGET * len(text) + 4096

    def find(self, text: str, sub: str, start: int) -> int:
        """The first ``sub`` at or after ``start`` (-1: none yet); the places found are
        kept, so that asking again from a later start (never an earlier one) reads only
        new text."""
        seen = self.markers.get(sub)
        if seen is None or not seen[0] <= start <= seen[-1]:  # what is kept may have gaps
            seen = self.markers[sub] = [start, start]
        k = bisect.bisect_left(seen, start, 1, len(seen) - 1)
        if k < len(seen) - 1:
            return seen[k]
        j = text.find(sub, max(start, seen[-1]))
        if j < 0:
            seen[-1] = max(seen[-1], len(text) - len(sub) + 1)
            return -1
        seen[-1:] = [j, j + 1]
        return j

    def rstrip_end(self, text: str, stop: int) -> int:
        """``len(text[:stop].rstrip())``, each stop's trailing spaces read once."""
        if stop not in self.stripped:
            k = stop
            while k > 0 and text[k - 1].isspace():
                k -= 1
            self.stripped[stop] = k
        return self.stripped[stop]


class Nesting:
    """Where the bracketed (or quoted) value opening at ``start`` closes: brackets counted
    outside quoted strings, in which a backslash escapes the next character. Any closer
    closes any opener (the caller checks the value itself once it closes)."""

    __slots__ = ("code", "quoted", "opens", "quotes", "key", "memo", "start", "follow",
                 "pos", "stack", "quote", "end")

    def __init__(self, start: int, syntax: tuple[str, str] = JSON,
                 memo: TextMemo | None = None) -> None:
        quotes, brackets = syntax
        self.code = _CODE[quotes + brackets]
        self.quoted = _QUOTED
        self.opens = brackets[0::2]
        self.quotes = quotes
        self.key, self.memo, self.start = quotes + brackets, memo or TextMemo(), start
        self.follow = self.memo.open_in.get((self.key, start))  # it scans for us
        self.pos, self.quote = start, ""
        self.stack: list[int] = []  # the openers not closed yet
        self.end = self.memo.closes.get((self.key, start))

    def close(self, text: str) -> int | None:
        """The index after the closing bracket, None while the value is open."""
        if self.end is None and self.follow is not None:
            self.follow.close(text)
            self.end = self.memo.closes.get((self.key, self.start))
            return self.end
        i, n = self.pos, len(text)
        if not self.memo.may_scan(text):
            return None
        while self.end is None and i < n:
            if self.quote:
                m = self.quoted[self.quote].search(text, i)
                if m is None:
                    i = n
                elif text[m.start()] == "\\":
                    i = m.start() + 2
                else:
                    self.quote, i = "", m.end()
                    if not self.stack:  # the value was this string
                        self.end = i
                continue
            m = self.code.search(text, i)
            if m is None:
                i = n
                continue
            c, i = m.group(), m.end()
            if c in self.quotes:
                self.quote = c
            elif c in self.opens:
                self.stack.append(i - 1)
                self.memo.open_in[self.key, i - 1] = self
            else:
                opener = self.stack.pop()
                self.memo.closes[self.key, opener] = i
                if not self.stack:
                    self.end = i
        self.memo.scanned += i - self.pos
        self.pos = i  # may pass n by one: the character after a final backslash is skipped
        return self.end


def held(text: str, lo: int, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text[lo:]`` that is a proper prefix of a marker:
    text a stream holds back until the next delta says whether a marker starts there."""
    for k in range(min(len(text) - lo, max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0
