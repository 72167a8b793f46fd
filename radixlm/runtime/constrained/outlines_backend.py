"""The outlines backend: outlines-core token indexes, interegular-checked regexes.

A JSON schema becomes a regex (outlines-core), every regex is checked in Python before the
uninterruptible Rust build (grammar.py), and two automata are built: the token Index (the
masks) and a byte DFA (jump-forward). Free-form JSON compiles, but slowly (seconds): its
regex is large. No EBNF.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from outlines_core import Index

from radixlm.runtime.constrained.base import Grammar, GrammarBackend
from radixlm.runtime.constrained.grammar import (
    GrammarLimits,
    build_byte_dfa,
    build_token_index,
    check_regex,
    schema_to_regex,
)
from radixlm.runtime.constrained.matcher import CompiledGrammar
from radixlm.runtime.constrained.vocabulary import tokenizer_info

logger = logging.getLogger(__name__)


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    kinds = frozenset({"regex", "json_schema"})
    warm_specs = ()  # its free-form json_object index takes seconds: built on demand
    # outlines-core's schema compiler silently ignores the bounds of numbers, uniqueness,
    # property counts and conditionals; only what it turns into the regex is listed
    schema_keywords = frozenset({
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
        "definitions", "pattern", "minLength", "maxLength", "format",
    })

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 limits: GrammarLimits | None = None) -> None:
        # the automata end on the tokenizer's EOS; other stop ids are special tokens,
        # which the token index never allows
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self.info = tokenizer_info(tokenizer)
        self.limits = limits or GrammarLimits()

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        start = time.perf_counter()
        regex = schema_to_regex(spec) if kind == "json_schema" else spec
        regex = check_regex(regex, self.limits)
        byte_initial, byte_transitions, byte_accepting = build_byte_dfa(regex, self.limits)
        index = build_token_index(regex, self.info)
        elapsed = time.perf_counter() - start
        logger.debug("compiled %s grammar (%d states) in %.3f s", kind, len(byte_transitions),
                     elapsed)
        return CompiledGrammar(kind, spec, regex, self.info, index, byte_initial,
                               byte_transitions, byte_accepting, compile_time_s=elapsed)

    def export(self, grammar: Grammar) -> dict[str, Any]:
        """The automata as plain data; the token index as outlines-core's own binary
        form (``Index.__reduce__``'s bytes, read back by ``Index.from_binary``)."""
        assert isinstance(grammar, CompiledGrammar)
        return {"regex": grammar.regex, "index": grammar.index.__reduce__()[1][0],
                "byte_initial": grammar.byte_initial,
                "byte_transitions": [[s, list(m.items())]
                                     for s, m in grammar.byte_transitions.items()],
                "byte_accepting": sorted(grammar.byte_accepting),
                "compile_time_s": grammar.compile_time_s}

    def restore(self, kind: str, spec: str, payload: Any) -> CompiledGrammar:
        transitions = {s: dict(m) for s, m in payload["byte_transitions"]}
        return CompiledGrammar(kind, spec, payload["regex"], self.info,
                               Index.from_binary(payload["index"]), payload["byte_initial"],
                               transitions, frozenset(payload["byte_accepting"]),
                               compile_time_s=payload["compile_time_s"])
