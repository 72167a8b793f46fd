"""The outlines backend's pipeline: specs -> checked regexes -> token and byte automata.

A grammar is a regex or a JSON schema; a JSON schema becomes a regex through outlines-core.
Every regex is checked in Python before any Rust automaton is built, because outlines-core's
Index construction cannot be interrupted: features a DFA cannot express are named in a
ValueError, and the size of the expanded pattern is bounded so memory stays bounded.

Two automata are built for each grammar, both by outlines-core over `(?:R)` + SENTINEL
(see vocabulary.py for why): the token Index over the tokenizer's vocabulary, which gives
the masks, and a byte Index over the 256 single bytes, which is the character-level DFA that
jump-forward follows.
"""

from __future__ import annotations

import re
import re._parser as sre_parse
from dataclasses import dataclass

from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from radixlm.runtime.constrained.regex_size import expanded_size
from radixlm.runtime.constrained.vocabulary import SENTINEL, SENTINEL_BYTES, TokenizerInfo

# Optional single spaces after ',' and ':': json.dumps-style output stays possible, and the
# model is never forced into newlines/indentation it would tokenise oddly.
JSON_WHITESPACE_PATTERN = r"[ ]?"
BYTE_SENTINEL_ID = 256

_UNSUPPORTED_TEXT = [
    ("(?=", "lookahead '(?='"),
    ("(?!", "negative lookahead '(?!'"),
    ("(?<=", "lookbehind '(?<='"),
    ("(?<!", "negative lookbehind '(?<!'"),
    ("(?>", "atomic group '(?>'"),
]


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds checked before any automaton is built."""

    max_regex_len: int = 100_000
    max_states: int = 10_000  # states of the byte-level DFA
    # Pattern size with bounded repeats unrolled: roughly the NFA size, checked in Python
    # before the (uninterruptible) DFA build, whose cost grows with it.
    max_expanded_size: int = 20_000


def _scan_text_features(regex: str) -> None:
    for needle, name in _UNSUPPORTED_TEXT:
        if needle in regex:
            raise ValueError(f"regex uses {name}, which a finite automaton cannot express")
    m = re.search(r"(?<!\\)(?:\\\\)*\\([1-9]|k<|b|B)", regex)
    if m:
        what = {"b": "word boundary '\\b'", "B": "non-boundary '\\B'"}.get(
            m.group(1), f"backreference '\\{m.group(1)}'"
        )
        raise ValueError(f"regex uses {what}, which a finite automaton cannot express")


def _strip_anchors(regex: str) -> str:
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex[:-1]) - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            regex = regex[:-1]
    return regex


def check_regex(regex: str, limits: GrammarLimits) -> str:
    """Validate `regex` for token-level compilation; return it with outer anchors removed."""
    if not isinstance(regex, str):
        raise ValueError(f"regex must be a string, got {type(regex).__name__}")
    if len(regex) > limits.max_regex_len:
        raise ValueError(
            f"regex is too long: {len(regex)} characters (limit {limits.max_regex_len})"
        )
    regex = _strip_anchors(regex)
    try:
        parsed = sre_parse.parse(regex)
    except RecursionError:
        raise ValueError("regex is nested too deeply") from None
    except re.error as e:
        # Rust-only syntax (\p{L}, [[:alpha:]]) fails here but may still be valid: the Rust
        # parser decides, and its error is reported if it disagrees.
        _scan_text_features(regex)
        _check_with_rust(regex, f"invalid regex: {e}")
        return regex
    try:
        expanded_size(list(parsed), limits.max_expanded_size)
    except RecursionError:
        raise ValueError("regex is nested too deeply") from None
    return regex


def _check_with_rust(regex: str, message: str) -> None:
    probe = Vocabulary(1, {b"\xff": [0]})
    try:
        Index(f"(?:{regex}){SENTINEL}", probe)
    except ValueError as e:
        if "incompatible" not in str(e):  # a parse error, not a missing-token error
            raise ValueError(message) from None


def schema_to_regex(canonical: str) -> str:
    """JSON schema text (from canonical_schema) -> regex, with outlines-core's errors wrapped."""
    try:
        return build_regex_from_schema(canonical, whitespace_pattern=JSON_WHITESPACE_PATTERN)
    except (ValueError, TypeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"unsupported json_schema: {first_line}") from None


_BYTE_VOCAB: Vocabulary | None = None


def _byte_vocabulary() -> Vocabulary:
    global _BYTE_VOCAB
    if _BYTE_VOCAB is None:
        table = {bytes([b]): [b] for b in range(256) if b != SENTINEL_BYTES[0]}
        table[SENTINEL_BYTES] = [BYTE_SENTINEL_ID]
        _BYTE_VOCAB = Vocabulary(BYTE_SENTINEL_ID + 1, table)
    return _BYTE_VOCAB


def build_byte_dfa(
    regex: str, limits: GrammarLimits
) -> tuple[int, dict[int, dict[int, int]], frozenset[int]]:
    """Byte-level DFA of a checked regex: (initial state, state -> {byte: next state},
    accepting states).

    A state is accepting when reading the sentinel (key BYTE_SENTINEL_ID) from it completes
    a match; the key alone is not enough, since R itself may also read that character.
    """
    try:
        index = Index(f"(?:{regex}){SENTINEL}", _byte_vocabulary())
    except ValueError as e:
        raise ValueError(f"invalid regex: {str(e).strip().splitlines()[0]}") from None
    transitions = index.get_transitions()
    if len(transitions) > limits.max_states:
        raise ValueError(
            f"grammar is too large: its automaton has {len(transitions)} states "
            f"(limit {limits.max_states})"
        )
    finals = set(index.get_final_states())
    accepting = frozenset(
        s for s, edges in transitions.items() if edges.get(BYTE_SENTINEL_ID, -1) in finals
    )
    return index.get_initial_state(), transitions, accepting


def build_token_index(regex: str, info: TokenizerInfo) -> Index:
    """Token-level Index of a checked regex over the tokenizer's vocabulary."""
    try:
        return Index(f"(?:{regex}){SENTINEL}", info.vocabulary)
    except ValueError as e:
        msg = str(e).strip().splitlines()[0]
        raise ValueError(f"the tokenizer's vocabulary cannot produce this grammar: {msg}") from None
