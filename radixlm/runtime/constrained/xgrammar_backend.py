"""The xgrammar backend (SGLang's and vLLM's default): a pushdown automaton with an adaptive
token mask cache. Compiles JSON schemas, regexes and EBNF in milliseconds; its matcher fills
a bitmask row, accepts, rolls back and finds the jump-forward string natively.

JSON schemas compile in xgrammar's strict mode: an object that declares ``properties`` and
says nothing of ``additionalProperties`` allows only those (``base.close_objects``, the
same rule for every backend); ``{"type": "object"}`` stays free-form JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from xgrammar import structural_tag as xst

from radixlm.runtime.constrained.base import (
    Grammar,
    GrammarBackend,
    Matcher,
    bitmask_width,
    close_objects,
    special_token_ids,
)
from radixlm.runtime.constrained.productivity import check_ebnf_productive
from radixlm.runtime.constrained.structural_tag import parse_structural_tag

logger = logging.getLogger(__name__)

# What xgrammar 0.2.9 enforces, each checked by tests/runtime/constrained/test_backends.py
# (an instance breaking it is refused, one keeping it accepted). Refused: uniqueItems,
# contains, not, if/then/else, dependent*, unevaluated*, allOf (it keeps one schema), and
# minProperties / maxProperties / patternProperties (its strict mode mishandles them).
# oneOf is compiled as anyOf.
XGRAMMAR_SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions",
    "pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "propertyNames",
})


class XGrammarMatcher(Matcher):
    def __init__(self, grammar: XGrammarGrammar) -> None:
        self.grammar = grammar
        self.m = xgr.GrammarMatcher(grammar.compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.m.is_terminated():
            return False
        return self.m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        if self.m.is_terminated():
            return True
        if not self.m.is_completed():  # more text is required: EOS is not even allowed
            return False
        scratch = self.grammar.scratch_row()
        self.m.fill_next_token_bitmask(scratch, 0)
        return self.grammar.only_stop_tokens(scratch)

    def is_accepting(self) -> bool:
        return self.m.is_terminated() or self.m.is_completed()

    def forced_string(self) -> str:
        if self.m.is_terminated():
            return ""
        return self.m.find_jump_forward_string()


class XGrammarGrammar(Grammar):
    def __init__(self, kind: str, compiled: xgr.CompiledGrammar, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self.kind, self.compiled, self.vocab_size = kind, compiled, vocab_size
        self.stop_token_ids = stop_token_ids
        width = bitmask_width(vocab_size)
        self._no_text = torch.zeros(width, dtype=torch.int32)  # stop tokens cleared

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)

    def scratch_row(self) -> torch.Tensor:
        return torch.empty((1, bitmask_width(self.vocab_size)), dtype=torch.int32)

    def only_stop_tokens(self, row: torch.Tensor) -> bool:
        """Whether a filled row allows nothing but stop tokens."""
        row = row[0].clone()
        for t in self.stop_token_ids:
            row[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else 0x7FFFFFFF
        return bool(torch.equal(row, self._no_text))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    schema_keywords = XGRAMMAR_SCHEMA_KEYWORDS

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()
                 ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        # xgrammar 0.2.9 takes special tokens such as <|im_end|> for text; an empty string
        # marks a token it must never produce. Ids past len(tokenizer) are never allowed.
        decoded = list(xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                          vocab_size=vocab_size).decoded_vocab)
        for i in special_token_ids(tokenizer):
            if i < len(decoded):
                decoded[i] = b""
        info = xgr.TokenizerInfo(decoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, kind: str, spec: str) -> XGrammarGrammar:
        try:
            if kind == "json_schema":
                grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False,
                                                       strict_mode=True)
                text = _json_string_chars(str(grammar))
            elif kind == "structural_tag":
                text = _json_string_chars(str(_structural_tag_grammar(spec)))
            elif kind == "regex":
                text = str(xgr.Grammar.from_regex(spec))
            else:
                text = str(xgr.Grammar.from_ebnf(spec))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid {kind} ({self.name}): {_first_line(e)}") from None
        # a rule that never ends makes the jump-forward string endless (memory, in the
        # scheduler): refused, in any state the matcher could reach
        check_ebnf_productive(text)
        try:
            compiled = self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid {kind} ({self.name}): {_first_line(e)}") from None
        return XGrammarGrammar(kind, compiled, self.vocab_size, self.stop_token_ids)


def _structural_tag_grammar(spec: str) -> xgr.Grammar:
    """Free text; after a trigger, one structure (begin, JSON, end). Each JSON value's
    objects are closed as the json_schema path closes them, and whitespace between its
    tokens is at most one character (a small model would otherwise fill it)."""
    tag = parse_structural_tag(spec)
    tags = [xst.TagFormat(begin=s.begin, end=s.end, content=xst.JSONSchemaFormat(
        json_schema=close_objects(s.schema), max_whitespace_cnt=1)) for s in tag.structures]
    fmt = xst.TriggeredTagsFormat(triggers=list(tag.triggers), tags=tags)
    return xgr.Grammar.from_structural_tag(xst.StructuralTag(format=fmt))


# xgrammar 0.2.9's JSON string characters: [^"\\\r\n] where a string has minLength or
# maxLength, which lets raw control characters through (output json.loads refuses), and
# [^\0-\x1f"\\\r\n] elsewhere; both take the UTF-8 encoding of a surrogate (U+D800-DFFF,
# not a character: it decodes to three U+FFFD, and a length check breaks) as one character.
# Both become what JSON allows.
_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _json_string_chars(ebnf: str) -> str:
    for lax in _STRING_CHARS:
        ebnf = ebnf.replace(lax, _JSON_STRING_CHARS)
    return ebnf


def _first_line(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a source location: keep the reason."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
