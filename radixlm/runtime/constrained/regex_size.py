"""The size of a regex with its bounded repeats unrolled, from Python's own parser: roughly
the size of its NFA, and so a bound on what an automaton built from it costs. Checked before
an uninterruptible build (outlines-core's Index; stop_regex's automaton). Features a finite
automaton cannot express are named in a ValueError on the way.

``check_min_match``: a regex whose shortest match is longer than any output can be
(``(a{2600}){2600}``: 6.76M characters) is refused before the compile worker probes it,
in microseconds rather than the seconds its forced text takes to find.
"""

from __future__ import annotations

import re
import re._constants as sre_c
import re._parser as sre_parse
from typing import Any

MIN_MATCH_CHECK_CHARS = 1 << 16  # longer patterns: Python's parse alone would take seconds


def unsupported_node(op: Any, av: Any) -> str | None:
    if op in (sre_c.GROUPREF, sre_c.GROUPREF_EXISTS):
        return "backreference"
    if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
        kind = "lookbehind" if av[0] < 0 else "lookahead"
        return kind if op is sre_c.ASSERT else f"negative {kind}"
    if op is sre_c.AT:
        if av in (sre_c.AT_BOUNDARY, sre_c.AT_UNI_BOUNDARY, sre_c.AT_LOC_BOUNDARY):
            return "word boundary '\\b'"
        if av in (sre_c.AT_NON_BOUNDARY, sre_c.AT_UNI_NON_BOUNDARY, sre_c.AT_LOC_NON_BOUNDARY):
            return "non-boundary '\\B'"
        return "anchor ('^', '$', '\\A', '\\Z') in the middle of the pattern"
    if op is sre_c.ATOMIC_GROUP:
        return "atomic group '(?>'"
    if op is sre_c.POSSESSIVE_REPEAT:
        return "possessive quantifier"
    return None


def expanded_size(items: Any, limit: int) -> int:
    """Size of the pattern with bounded repeats unrolled; raises ValueError on bad features."""
    total = 0
    for op, av in items:
        what = unsupported_node(op, av)
        if what is not None:
            raise ValueError(f"regex uses {what}, which a finite automaton cannot express")
        if op is sre_c.SUBPATTERN:
            total += expanded_size(av[3], limit)
        elif op is sre_c.BRANCH:
            total += sum(expanded_size(branch, limit) for branch in av[1])
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
            lo, hi, sub = av
            times = max(lo, 1) if hi is sre_c.MAXREPEAT else max(hi, 1)
            total += times * expanded_size(sub, limit)
        else:
            total += 1
        if total > limit:
            raise ValueError(
                f"regex is too large: it expands to more than {limit} elements "
                "(bounded repeats such as {n,m} are unrolled)"
            )
    return total


def check_min_match(pattern: str, max_chars: int) -> None:
    """ValueError if every match of ``pattern`` has more than ``max_chars`` characters
    (0: no check). Patterns Python's parser does not read (xgrammar's ``\\p{L}``) or longer
    than ``MIN_MATCH_CHECK_CHARS`` are left to the compile worker's probe."""
    if not max_chars or len(pattern) > MIN_MATCH_CHECK_CHARS:
        return
    try:
        shortest = sre_parse.parse(pattern).getwidth()[0]
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    if shortest > max_chars:
        raise ValueError(f"the regex's shortest match has {shortest} characters, more than "
                         f"an output can hold ({max_chars}: the context length times the "
                         "longest token's characters)")
