"""The grammar backends at the matcher level, without a model: each keyword a backend
claims to enforce is enforced (an instance breaking it is refused, one keeping it is
accepted), every other keyword is refused with the backend, the keyword and where it is;
special tokens are never text; canonical jump-forward gives the tokenizer's own encoding."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from radixlm.runtime.config import GRAMMAR_BACKENDS
from radixlm.runtime.constrained import (
    allocate_token_bitmask,
    allowed_ids,
    canonical_spec,
    create_grammar_backend,
)
from radixlm.runtime.constrained.base import ANNOTATION_KEYWORDS, close_objects
from radixlm.runtime.constrained.jump_forward import canonical_jump
from radixlm.runtime.tokenizer import load_tokenizer
from radixlm.tiny_model import default_tiny_model_path

VOCAB = 2000


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(default_tiny_model_path("llama")))


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def backend(request, tokenizer):
    return create_grammar_backend(request.param, tokenizer, VOCAB, [tokenizer.eos_token_id])


def matches(backend, tokenizer, kind: str, spec: Any, text: str) -> bool:
    """Whether the grammar accepts ``text`` (as the tokenizer encodes it), then ends."""
    m = backend.compile(kind, canonical_spec(kind, spec)).new_matcher()
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not m.accept_token(t):
            return False
    return m.accept_token(tokenizer.eos_token_id) or m.is_terminated()


# keyword -> (schema, an instance that breaks the keyword, one that keeps it)
KEYWORD_CASES: dict[str, tuple[dict, str, str]] = {
    "minimum": ({"type": "integer", "minimum": 5}, "3", "7"),
    "maximum": ({"type": "integer", "maximum": 5}, "9", "4"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "5", "6"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "5", "4"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4", "6"),
    "minLength": ({"type": "string", "minLength": 3}, '"a"', '"abc"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"abcd"', '"ab"'),
    "pattern": ({"type": "string", "pattern": "^[0-9]+$"}, '"ab"', '"12"'),
    "format": ({"type": "string", "format": "date"}, '"ab"', '"2024-01-02"'),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]",
                 "[1, 2]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1, 2]",
                 "[1]"),
    "items": ({"type": "array", "items": {"type": "integer"}}, '["a"]', "[1]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False},
                    "[1]", '["a"]'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}", '{"a": 1}'),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a": 1, "b": 2}',
                      '{"a": 1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 1}}, '{"abc": 1}',
                      '{"a": 1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, '{"xa": "s"}', '{"xa": 1}'),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": False}, '{"b": 1}', '{"a": 1}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"]}, "{}", '{"a": 1}'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}},
                   '{"a": "x"}', '{"a": 1}'),
    "type": ({"type": "integer"}, '"a"', "1"),
    "enum": ({"enum": [1, 2]}, "3", "2"),
    "const": ({"const": 3}, "4", "3"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, '"a"', "null"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, '"a"', "null"),
    "allOf": ({"allOf": [{"type": "integer"}]}, '"a"', "1"),
    "$ref": ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, '"a"', "1"),
}
STRUCTURAL = {"$defs", "definitions"}  # containers of the keywords above


@pytest.mark.parametrize("keyword", sorted(KEYWORD_CASES))
def test_claimed_keywords_are_enforced(backend, tokenizer, keyword):
    schema, bad, good = KEYWORD_CASES[keyword]
    try:
        backend.check_schema(schema)
    except ValueError as e:
        assert keyword not in backend.schema_keywords, e
        assert backend.name in str(e) and f"'{keyword}'" in str(e)
        return
    assert keyword in backend.schema_keywords | STRUCTURAL
    assert not matches(backend, tokenizer, "json_schema", schema, bad), (keyword, bad)
    assert matches(backend, tokenizer, "json_schema", schema, good), (keyword, good)


def test_every_claimed_keyword_is_tested(backend):
    assert backend.schema_keywords - set(KEYWORD_CASES) <= STRUCTURAL


@pytest.mark.parametrize("keyword", ["uniqueItems", "not", "if", "contains", "dependentRequired",
                                     "unevaluatedProperties"])
def test_unenforceable_keywords_are_refused_with_their_place(backend, keyword):
    schema = {"type": "object", "properties": {"a": {"type": "array", keyword: {}}}}
    with pytest.raises(ValueError) as e:
        backend.compile("json_schema", canonical_spec("json_schema", schema))
    assert backend.name in str(e.value) and f"'{keyword}' at #/properties/a" in str(e.value)


def test_annotations_are_accepted(backend, tokenizer):
    schema = {"title": "T", "description": "d", "$schema": "x", "type": "integer",
              "examples": [1], "default": 1}
    assert set(schema) - {"type"} <= ANNOTATION_KEYWORDS
    assert matches(backend, tokenizer, "json_schema", schema, "12")


def test_strings_hold_no_control_characters_and_whole_characters(backend, tokenizer):
    """JSON forbids raw U+0000-U+001F in strings; a surrogate is not a character."""
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 5}):
        assert not matches(backend, tokenizer, "json_schema", schema, '"a\x06"')
        m = backend.compile("json_schema", canonical_spec("json_schema", schema)).new_matcher()
        surrogate = tokenizer.convert_tokens_to_ids(['"', "í", "¢", "ĭ", '"'])  # ED A2 8B
        assert not all(m.accept_token(t) for t in surrogate)


def test_special_tokens_are_never_text(backend, tokenizer):
    m = backend.compile("json_schema", canonical_spec("json_schema", {"type": "object"})
                        ).new_matcher()
    for t in tokenizer.encode('{"a', add_special_tokens=False):
        assert m.accept_token(t)
    bitmask = allocate_token_bitmask(1, VOCAB)
    m.fill_bitmask(bitmask, 0)
    allowed = set(allowed_ids(bitmask[0], VOCAB))
    assert not allowed & set(tokenizer.all_special_ids)
    assert len(allowed) > 1000


def test_free_form_and_closed_objects(backend, tokenizer):
    free = {"type": "object"}
    assert matches(backend, tokenizer, "json_schema", free, '{"x": [1, {"y": null}]}')
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not matches(backend, tokenizer, "json_schema", closed, '{"a": 1, "b": 2}')
    assert close_objects(closed)["additionalProperties"] is False
    assert "additionalProperties" not in close_objects(free)


def test_ebnf_where_supported(backend, tokenizer):
    grammar = 'root ::= "(" [0-9]+ ")"'
    if "ebnf" not in backend.kinds:
        with pytest.raises(ValueError, match=f"{backend.name} grammar backend cannot enforce"):
            backend.compile("ebnf", grammar)
        return
    assert matches(backend, tokenizer, "ebnf", grammar, "(42)")
    assert not matches(backend, tokenizer, "ebnf", grammar, "(4a)")


def test_rollback_restores_the_state(backend, tokenizer):
    m = backend.compile("regex", "abc(de)?").new_matcher()
    ids = tokenizer.encode("abcde", add_special_tokens=False)
    assert all(m.accept_token(t) for t in ids)
    assert m.is_terminated()
    m.rollback(len(tokenizer.encode("de", add_special_tokens=False)))
    assert not m.is_terminated()
    assert m.accept_token(tokenizer.eos_token_id) and m.is_terminated()


# --- canonical jump-forward ---------------------------------------------------------------
LONG_KEYS = {"type": "object", "properties": {
    "customer_identifier": {"type": "integer"},
    "preferred_contact_channel": {"enum": ["email", "telephone"]}},
    "required": ["customer_identifier", "preferred_contact_channel"]}


def _matcher_after(backend, tokenizer, text: str):
    m = backend.compile("json_schema", canonical_spec("json_schema", LONG_KEYS)).new_matcher()
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert m.accept_token(t), text
    return m


def test_jump_forward_from_the_start_is_the_tokenizers_encoding(backend, tokenizer):
    m = _matcher_after(backend, tokenizer, "")
    forced = m.forced_string()
    assert forced.startswith("{")
    jump = canonical_jump(m, tokenizer, [], forced)
    assert jump is not None and jump.rollback == 0
    assert jump.ids == tokenizer.encode(forced, add_special_tokens=False)


# after the separator (space or tab) there is one way on
JSONISH = r'x(1|2),( |\t)"preferred_contact_channel": (3|4)'


def test_jump_forward_re_encodes_the_sampled_token_with_the_forced_text(backend, tokenizer):
    """After 'x1,' the model samples ' '; the grammar forces '"preferred_contact_channel": '.
    The step's tokens become the tokenizer's own encoding of ' ' + forced: one ' "' token,
    where ' ' and '"' encoded apart are two tokens the model never sees together."""
    m = backend.compile("regex", JSONISH).new_matcher()
    for t in tokenizer.encode("x1,", add_special_tokens=False):
        assert m.accept_token(t)
    space = tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1 and m.accept_token(space[0])
    forced = m.forced_string()
    assert forced == '"preferred_contact_channel": ', forced
    jump = canonical_jump(m, tokenizer, space, forced)
    assert jump is not None
    step = space[: len(space) - jump.rollback] + jump.ids
    assert step == tokenizer.encode(" " + forced, add_special_tokens=False)
    naive = space + tokenizer.encode(forced, add_special_tokens=False)
    assert step != naive and jump.rollback == 1  # the merge this exists for
    for t in tokenizer.encode("3", add_special_tokens=False):
        assert m.accept_token(t)
    assert m.is_terminated()


def test_jump_forward_that_the_grammar_refuses_changes_nothing(backend, tokenizer):
    m = _matcher_after(backend, tokenizer, '{"customer_identifier": 12')
    before = allocate_token_bitmask(1, VOCAB)
    m.fill_bitmask(before, 0)
    assert canonical_jump(m, tokenizer, [], "xyz") is None
    after = allocate_token_bitmask(1, VOCAB)
    m.fill_bitmask(after, 0)
    assert torch.equal(before, after)


def test_forced_strings_agree_across_backends(tokenizer):
    """Where the grammar leaves one way on, every backend forces the same text."""
    forced = {}
    for name in GRAMMAR_BACKENDS:
        backend = create_grammar_backend(name, tokenizer, VOCAB, [tokenizer.eos_token_id])
        m = backend.compile("regex", JSONISH).new_matcher()
        for t in tokenizer.encode("x2,\t", add_special_tokens=False):
            assert m.accept_token(t)
        forced[name] = m.forced_string()
    assert set(forced.values()) == {'"preferred_contact_channel": '}, json.dumps(forced)
