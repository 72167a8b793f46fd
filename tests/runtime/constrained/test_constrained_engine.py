"""Constrained decoding through the Engine: outputs match their regex / JSON schema,
jump-forward keeps them valid, masking equals a hand-masked greedy run, and constrained
requests do not disturb unconstrained ones in the same batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from radixlm.runtime.constrained import GrammarCompiler

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
     "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["x", "y"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"},
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
                                                                      "maxLength": 4}},
     "required": ["a"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
     "required": ["code"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "integer"},
    {"type": "boolean"},
    {"enum": [1, 2, "three", None]},
    {"type": "object", "properties": {"level": {"type": "integer", "minDigits": 1,
                                                "maxDigits": 2}}, "required": ["level"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "q": {"type": "object", "properties": {"r": {"type": "boolean"}},
              "required": ["r"]}}, "required": ["q"]}}, "required": ["p"]},
    {"type": "object", "properties": {"status": {"const": "done"}}, "required": ["status"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"},
                                                      {"type": "boolean"}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 5},
                                      "last_name": {"type": "string", "maxLength": 5}},
     "required": ["first_name", "last_name"]},
    {"type": "object", "properties": {"score": {"type": "number"},
                                      "passed": {"type": "boolean"}},
     "required": ["score", "passed"]},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                      "count": {"type": "integer"}},
     "required": ["kind", "count"]},
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,6}",
    r"-?[0-9]+(\.[0-9]+)?",
    r"(True|False)",
    r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}",
    r"#[0-9a-f]{6}",
    r"\([0-9]{3}\) [0-9]{3}",
    r"(cat|dog)s?",
    r"[0-9]{1,2}:[0-9]{2} (AM|PM)",
    r"https://[a-z]{2,8}\.(com|org)",
]

LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "maxDigits": 6},
        "preferred_contact_method_for_support": {"enum": ["email", "phone"]},
        "has_accepted_the_terms_and_conditions": {"type": "boolean"},
    },
    "required": ["customer_identification_number", "preferred_contact_method_for_support",
                 "has_accepted_the_terms_and_conditions"],
}


@pytest.fixture(scope="module")
def eng(make_module_engine, tiny_llama_dir):
    return make_module_engine(model_path=str(tiny_llama_dir), max_total_tokens=16384)


@pytest.fixture(scope="module")
def eng_nojump(make_module_engine, tiny_llama_dir):
    return make_module_engine(model_path=str(tiny_llama_dir), max_total_tokens=8192,
                              disable_jump_forward=True)


def _check_outputs(outs, kinds):
    finished = 0
    for out, (kind, spec) in zip(outs, kinds):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue  # ran out of max_new_tokens inside a free-text field
        finished += 1
        if kind == "regex":
            assert re.fullmatch(spec, out["text"]), (spec, out["text"])
        else:
            jsonschema.validate(json.loads(out["text"]), spec)
    return finished


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_sampled_outputs_match_their_grammar(eng, seed):
    kinds = [("json_schema", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES]
    params = [{"max_new_tokens": 96, "temperature": 1.0, "seed": seed + i, kind: spec}
              for i, (kind, spec) in enumerate(kinds)]
    outs = eng.generate(["Answer:"] * len(kinds), params)
    assert _check_outputs(outs, kinds) >= len(kinds) // 2


def test_jump_forward_on_and_off_valid(eng, eng_nojump):
    sp = {"max_new_tokens": 160, "temperature": 0.7, "json_schema": LONG_KEYS_SCHEMA}
    kinds = [("json_schema", LONG_KEYS_SCHEMA)] * 4
    for e in (eng, eng_nojump):
        before = e.get_server_info()
        outs = e.generate(["Customer record:"] * 4, [{**sp, "seed": i} for i in range(4)])
        assert _check_outputs(outs, kinds) == 4
        jumped = e.get_server_info()["jump_forward_tokens"] - before["jump_forward_tokens"]
        assert (jumped > 0) == (e is eng)


def test_greedy_equals_hand_masked_run(eng_nojump, tiny_llama_dir):
    """No jump-forward, greedy: the engine's tokens equal an unconstrained model run whose
    logits are masked by hand with the grammar's allowed tokens."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    compiler = GrammarCompiler(eng_nojump.tokenizer)
    for kind, spec in [("json_schema", SCHEMAS[6]), ("regex", REGEXES[5])]:
        prompt = eng_nojump.tokenizer.encode("Data:", add_special_tokens=False)
        out = eng_nojump.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 40, "temperature": 0, kind: spec})
        matcher = compiler.compile(kind, spec).new_matcher()
        ids, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(40):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                allowed = torch.tensor(matcher.allowed_token_ids())
                masked = torch.full_like(logits, float("-inf"))
                masked[allowed] = logits[allowed]
                tok = int(masked.argmax())
                expected.append(tok)
                matcher.accept_token(tok)
                if matcher.is_terminated():
                    break
                ids.append(tok)
        assert out["output_ids"] == expected, (kind, out["output_ids"], expected)
    compiler.shutdown()


def test_unconstrained_rows_unaffected_by_constrained_neighbours(eng):
    plain = ["Once upon a time", "The capital of France is", "def f(x):"]
    greedy = {"max_new_tokens": 20, "temperature": 0}
    alone = eng.generate(plain, greedy)
    mixed = eng.generate(plain[:1] + ["JSON:"] + plain[1:] + ["Phone:"],
                         [greedy, {**greedy, "json_schema": SCHEMAS[6]}, greedy, greedy,
                          {**greedy, "regex": REGEXES[0]}])
    got = [mixed[0], mixed[2], mixed[3]]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in alone]
    assert re.fullmatch(REGEXES[0], mixed[4]["text"])


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("field, spec, match", [
    ("regex", "(?=a)b", "lookahead"),
    ("regex", r"(a)\1", "backreference"),
    ("regex", r"\bword", r"\\b"),
    ("regex", "([a-z]", "regex"),
    ("json_schema", "{not json", "JSON"),
    ("json_schema", _deep_schema(10_000), "deep"),
    ("json_schema", {"type": "integer", "maximum": 9}, "maximum"),
    ("json_schema", [1, 2], "object"),
])
def test_bad_grammars_are_value_errors(eng, field, spec, match):
    with pytest.raises(ValueError, match=match):
        eng.generate("x", {"max_new_tokens": 8, field: spec})
    # the engine keeps serving
    assert eng.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_pathological_regex_is_bounded(eng):
    out = eng.generate("x", {"max_new_tokens": 16, "temperature": 0, "regex": "(a+)+b"})
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch("(a+)+b", out["text"])


def test_both_regex_and_schema_rejected(eng):
    with pytest.raises(ValueError, match="regex"):
        eng.generate("x", {"max_new_tokens": 4, "regex": "a", "json_schema": {"type": "integer"}})
