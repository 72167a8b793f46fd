"""``stop_regex`` (SGLang's sampling parameter): finish when the output contains a match.

Each pattern becomes a finite automaton (interegular) for "any text, then the pattern", so
a search is one pass over the text with no backtracking: a pattern such as ``(a+)+b`` costs
what ``ab`` costs, and no request can stall the scheduler with one. Features a finite
automaton cannot express (backreferences, word boundaries) are a ValueError (HTTP 400).
The scheduler searches the decoded tail of the output (``STOP_REGEX_WINDOW`` tokens), as
SGLang searches a bounded tail: a match longer than that is not seen.
"""

from __future__ import annotations

import functools
from typing import Any

import interegular

STOP_REGEX_WINDOW = 64  # output tokens searched each step


@functools.lru_cache(maxsize=1024)
def stop_automaton(pattern: str) -> Any:
    """The FSM of ``[\\s\\S]*(?:pattern)``; ValueError for a pattern it cannot express."""
    try:
        return interegular.parse_pattern(f"[\\s\\S]*(?:{pattern})").to_fsm()
    except Exception as e:  # noqa: BLE001 - interegular's errors name no common base
        raise ValueError(f"stop_regex {pattern!r} cannot be used: {type(e).__name__} "
                         f"{e}".strip()) from None


def contains_match(pattern: str, text: str) -> bool:
    """Whether ``text`` contains a match of ``pattern`` (ending anywhere in it)."""
    fsm = stop_automaton(pattern)
    state = fsm.initial
    if state in fsm.finals:  # the empty string matches
        return True
    for ch in text:
        state = fsm.map.get(state, {}).get(fsm.alphabet[ch])
        if state is None:
            return False
        if state in fsm.finals:
            return True
    return False
