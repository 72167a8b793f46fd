"""Resumable scans over a text that only grows: a streamed output, read delta by delta.

Each scan remembers where it stopped and goes on from there when the text has grown, so
reading an output of n characters, however it is cut into deltas, examines each character
a bounded number of times. That keeps every tool-call and reasoning parser linear in its
output: re-reading the whole text at each delta is quadratic, and a tenant can force a
long unclosed call (``tests/runtime/entrypoints/function_call/test_parser_cost.py``).
"""

from __future__ import annotations

import re

_SPACES = re.compile(r"\s*")


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
    """The end of the run of ``chars`` (a regex ``[...]*``) from ``start``: settled once
    another character follows it."""

    __slots__ = ("chars", "end", "settled")

    def __init__(self, start: int, chars: re.Pattern[str] = _SPACES) -> None:
        self.chars, self.end, self.settled = chars, start, False

    def skip(self, text: str) -> int:
        if not self.settled:
            self.end = self.chars.match(text, self.end).end()
            self.settled = self.end < len(text)
        return self.end


def spaces(start: int) -> Run:
    """The whitespace run from ``start``."""
    return Run(start)


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


class Nesting:
    """Where the bracketed (or quoted) value opening at ``start`` closes: brackets counted
    outside quoted strings, in which a backslash escapes the next character. Any closer
    closes any opener (the caller checks the value itself once it closes)."""

    __slots__ = ("code", "quoted", "opens", "quotes", "pos", "depth", "quote", "end")

    def __init__(self, start: int, quotes: str = '"', brackets: str = "[]{}") -> None:
        self.code = re.compile("[" + re.escape(quotes + brackets) + "]")
        self.quoted = {q: re.compile(r"[\\" + q + "]") for q in quotes}
        self.opens = brackets[0::2]
        self.quotes = quotes
        self.pos, self.depth, self.quote = start, 0, ""
        self.end: int | None = None

    def close(self, text: str) -> int | None:
        """The index after the closing bracket, None while the value is open."""
        i, n = self.pos, len(text)
        while self.end is None and i < n:
            if self.quote:
                m = self.quoted[self.quote].search(text, i)
                if m is None:
                    i = n
                elif text[m.start()] == "\\":
                    i = m.start() + 2
                else:
                    self.quote, i = "", m.end()
                    if self.depth == 0:  # the value was this string
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
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
        self.pos = i  # may pass n by one: the character after a final backslash is skipped
        return self.end
