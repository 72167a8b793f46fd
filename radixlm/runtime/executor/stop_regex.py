"""``stop_regex`` (SGLang's sampling parameter): finish when the output contains a match.

Each pattern becomes a finite automaton (interegular) for "any text, then the pattern", so
a search is one pass over the text with no backtracking: a pattern such as ``(a+)+b`` costs
what ``ab`` costs, and no request can stall the scheduler with one. Features a finite
automaton cannot express (backreferences, word boundaries) are a ValueError (HTTP 400).
The scheduler searches the decoded tail of the output (``STOP_REGEX_WINDOW`` tokens), as
SGLang searches a bounded tail: a match longer than that is not seen.

The automaton is built in the HTTP process (SamplingParams.verify), so its cost is bounded
before it is built: the size of a request's patterns with bounded repeats unrolled
(``(a{1000}){1000}`` is a million), all together, is at most ``MAX_STOP_REGEX_SIZE`` (256:
about 0.3 s of automaton building at worst), and every automaton interegular crawls
(each union, concatenation, repetition, and the final subset construction, which can grow
exponentially: ``(a|b)*a(a|b){20}``) stops at ``MAX_STOP_REGEX_STATES`` states. Beyond
either the pattern is a ValueError naming the limit.
"""

from __future__ import annotations

import functools
import re
import re._parser as sre_parse
import threading
from typing import Any

import interegular
import interegular.fsm as ifsm

from radixlm.runtime.constrained.regex_size import expanded_size

STOP_REGEX_WINDOW = 64  # output tokens searched each step
MAX_STOP_REGEX_CHARS = 1_000
MAX_STOP_REGEX_SIZE = 256  # elements, bounded repeats unrolled, of all of a request's patterns
MAX_STOP_REGEX_STATES = 2_000  # states of any automaton built for one pattern


class _TooManyStates(Exception):
    pass


_bounds = threading.local()  # .active: set while stop_automaton builds on this thread
_unbounded_crawl = ifsm.crawl


def _bounded_crawl(alphabet: Any, initial: Any, final: Any, follow: Any) -> Any:
    """interegular's ``crawl`` (explore an automaton from its initial state), stopping
    past MAX_STOP_REGEX_STATES states, and with an index instead of a list search; only
    inside ``stop_automaton`` (other users of interegular keep its own crawl)."""
    if not getattr(_bounds, "active", False):
        return _unbounded_crawl(alphabet, initial, final, follow)
    states, index, finals, transitions = [initial], {_freeze(initial): 0}, set(), {}
    i = 0
    while i < len(states):
        if final(states[i]):
            finals.add(i)
        transitions[i] = row = {}
        for symbol in alphabet.by_transition:
            try:
                nxt = follow(states[i], symbol)
            except ifsm.OblivionError:
                continue
            key = _freeze(nxt)
            j = index.get(key)
            if j is None:
                if len(states) >= MAX_STOP_REGEX_STATES:
                    raise _TooManyStates
                j = index[key] = len(states)
                states.append(nxt)
            row[symbol] = j
        i += 1
    return ifsm.FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals,
                    map=transitions, __no_validation__=True)


def _freeze(state: Any) -> Any:
    """A hashable form of an interegular crawl state (sets, lists, tuples, dicts)."""
    if isinstance(state, (set, frozenset)):
        return frozenset(_freeze(x) for x in state)
    if isinstance(state, (list, tuple)):
        return tuple(_freeze(x) for x in state)
    if isinstance(state, dict):
        return frozenset((_freeze(k), _freeze(v)) for k, v in state.items())
    return state


ifsm.crawl = _bounded_crawl  # every FSM operation of interegular crawls through it


def check_stop_regex(pattern: str) -> int:
    """The pattern's size with its repeats unrolled; ValueError if it is too long, or larger
    than MAX_STOP_REGEX_SIZE, or uses what an automaton cannot express. Cheap: no automaton."""
    if len(pattern) > MAX_STOP_REGEX_CHARS:
        raise ValueError(f"stop_regex has {len(pattern)} characters "
                         f"(limit {MAX_STOP_REGEX_CHARS})")
    try:
        parsed = sre_parse.parse(pattern)
        return expanded_size(list(parsed), MAX_STOP_REGEX_SIZE)
    except RecursionError:
        raise ValueError("stop_regex is nested too deeply") from None
    except re.error as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {e}") from None
    except ValueError as e:
        raise ValueError(f"stop_regex {pattern!r} cannot be used: {e} "
                         f"(limit {MAX_STOP_REGEX_SIZE})" if "too large" in str(e)
                         else f"stop_regex {pattern!r} cannot be used: {e}") from None


@functools.lru_cache(maxsize=1024)
def stop_automaton(pattern: str) -> Any:
    """The FSM of ``[\\s\\S]*(?:pattern)``; ValueError for a pattern it cannot express or
    one beyond the limits above."""
    check_stop_regex(pattern)
    _bounds.active = True
    try:
        return interegular.parse_pattern(f"[\\s\\S]*(?:{pattern})").to_fsm()
    except _TooManyStates:
        raise ValueError(f"stop_regex {pattern!r} needs an automaton of more than "
                         f"{MAX_STOP_REGEX_STATES} states (the limit)") from None
    except RecursionError:
        raise ValueError("stop_regex is nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - interegular's errors name no common base
        raise ValueError(f"stop_regex {pattern!r} cannot be used: {type(e).__name__} "
                         f"{e}".strip()) from None
    finally:
        _bounds.active = False


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
