"""The llguidance backend (Microsoft's, used by vLLM and SGLang as an alternative): an Earley
parser over a lazily built lexer, so there is almost nothing to compile; the matcher does
the work per token. JSON schemas, regexes, and EBNF (GBNF, converted to its Lark dialect).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from radixlm.runtime.constrained.base import Grammar, GrammarBackend, Matcher, close_objects
from radixlm.runtime.constrained.structural_tag import parse_structural_tag

logger = logging.getLogger(__name__)

# What llguidance enforces, each checked by tests/runtime/constrained/test_backends.py (it
# refuses the rest itself too, without saying where). No oneOf.
LLGUIDANCE_SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions",
    "pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties", "patternProperties",
})


# json.dumps-style separators, as the other backends; no free whitespace (a small model
# would fill it with newlines)
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance computes masks lazily (Earley items, lexer states built per token), in the
    scheduler: these bound each step's work and the lexer's memory (about 2 kB a state, so
    50,000 states ~ 100 MB instead of its default 250,000). A matcher that reaches one enters
    its error state; its mask then allows nothing and the request ends as a 400."""
    return llguidance.LLParserLimits(step_lexer_fuel=200_000, step_max_items=50_000,
                                     max_lexer_states=50_000, max_grammar_size=200_000,
                                     initial_lexer_fuel=1_000_000, verbose_errors=False)


class LLGuidanceMatcher(Matcher):
    def __init__(self, grammar: LLGuidanceGrammar) -> None:
        self.m = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0,
                                      limits=parser_limits())
        if self.m.is_error():
            raise ValueError(f"invalid {grammar.kind} (llguidance): {self.m.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        # a refused token would leave the matcher in its error state: ask first
        if self.m.is_stopped() or self.m.validate_tokens([token_id]) != 1:
            return False
        return self.m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    def error(self) -> str:
        """The matcher's error (a limit reached while computing a mask), or ''."""
        return self.m.get_error() if self.m.is_error() else ""

    def forced_string(self) -> str:
        if self.m.is_stopped():
            return ""
        data = self.m.compute_ff_bytes()
        return _complete_utf8(data)


class LLGuidanceGrammar(Grammar):
    def __init__(self, kind: str, text: str, tokenizer: Any) -> None:
        self.kind, self.text, self.tokenizer = kind, text, tokenizer

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    schema_keywords = LLGUIDANCE_SCHEMA_KEYWORDS

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=self.stop_token_ids)

    def _compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        try:
            if kind == "json_schema":
                schema = close_objects(json.loads(spec))
                schema.pop("$schema", None)  # llguidance would try to fetch the meta-schema
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults=JSON_DEFAULTS)
            elif kind == "structural_tag":
                text = _structural_tag_grammar(spec)
            elif kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(spec)
            else:
                text = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec))
        except Exception as e:  # noqa: BLE001 - its converters raise plain Exception too
            raise ValueError(f"invalid {kind} (llguidance): {_first_line(e)}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer,
                                                      limits=parser_limits())
        if error:
            raise ValueError(f"invalid {kind} (llguidance): {_first_line(error)}")
        return LLGuidanceGrammar(kind, text, self.ll_tokenizer)


def _structural_tag_grammar(spec: str) -> str:
    """llguidance's StructTag grammar: lazy triggers (matched as text, not assumed to be
    special tokens), each JSON value closed and with the separators of JSON_DEFAULTS."""
    tag = parse_structural_tag(spec)
    structs = []
    for s in tag.structures:
        schema = close_objects(s.schema)
        schema.pop("$schema", None)
        schema["x-guidance"] = dict(JSON_DEFAULTS)
        trigger = next(t for t in tag.triggers if s.begin.startswith(t))
        structs.append(llguidance.StructTag(trigger=trigger, begin=s.begin, grammar=schema,
                                            end=s.end))
    lark = llguidance.StructTag.to_grammar(structs, assume_special=False)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _complete_utf8(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def _first_line(e: Exception | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "rejected"
