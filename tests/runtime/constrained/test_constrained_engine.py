"""The conformance suite of the grammar backends, through the Engine, parametrised over
xgrammar, llguidance and outlines: sampled outputs (temperature 1, seeds) match their JSON
schema / regex / EBNF, jump-forward keeps them valid, masking equals a hand-masked greedy
transformers run with the same backend, forced tokens obey stops, constrained requests do
not disturb unconstrained ones, and bad grammars are ValueErrors. A schema a backend
documents it cannot enforce (its ``check_schema`` refuses it) is skipped for that backend
only, and must be refused, never run."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from radixlm.runtime.config import GRAMMAR_BACKENDS
from radixlm.runtime.constrained import (
    allocate_token_bitmask,
    allowed_ids,
    canonical_spec,
    create_grammar_backend,
)

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
    {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1,
                                                "maximum": 99}}, "required": ["level"]},
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
    # free-form objects (OpenAI's json_object), optional properties, arrays of objects
    {"type": "object"},
    {"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}},
    {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tag": {"enum": ["x", "y"]}}, "required": ["id", "tag"]},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "n": {"type": "integer"}}, "required": ["id", "n"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"},
                                                      {"type": "string", "maxLength": 3}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"t": {"type": "array", "prefixItems": [
        {"type": "integer"}, {"type": "boolean"}], "items": False}}, "required": ["t"]},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}},
     "properties": {"p": {"$ref": "#/$defs/pt"}, "q": {"$ref": "#/$defs/pt"}},
     "required": ["p", "q"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0,
                                                "maximum": 1}}, "required": ["ratio"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2,
                                               "maxLength": 4}}, "required": ["word"]},
    {"type": "object", "properties": {"ok": {"const": True}, "why": {"type": "null"}},
     "required": ["ok", "why"]},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 5},
    {"type": "string", "maxLength": 6},
    {"type": "number"},
    {"type": "null"},
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
    r"[a-z0-9._]{1,8}@[a-z]{2,6}\.(com|net|io)",
    r"(0|[1-9][0-9]{0,2})(,[0-9]{3})?",
    r"[A-Z]{2}[0-9]{2} [A-Z]{3}",
    r"(red|green|blue)( and (red|green|blue))?",
    r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
]

EBNFS = [
    ('root ::= "yes" | "no" | "maybe"', r"yes|no|maybe"),
    ('root ::= "(" [0-9]+ ")" " " [a-z]+', r"\([0-9]+\) [a-z]+"),
    ('root ::= item ("," item)*\nitem ::= [a-c] [0-9]', r"[a-c][0-9](,[a-c][0-9])*"),
]

LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "string", "pattern": "^[0-9]{1,6}$"},
        "preferred_contact_method_for_support": {"enum": ["email", "phone"]},
        "has_accepted_the_terms_and_conditions": {"type": "boolean"},
    },
    "required": ["customer_identification_number", "preferred_contact_method_for_support",
                 "has_accepted_the_terms_and_conditions"],
}


# These tests check what the backends enforce, not the compile time limit (tested in
# test_grammar_limits.py): outlines takes 11 s for a free-form {"type": "object"} on an idle
# machine here, more than the default 10 s limit on a slower one.
COMPILE_LIMIT_S = 300.0


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def backend_name(request):
    return request.param


@pytest.fixture(scope="module")
def eng(make_module_engine, tiny_llama_dir, backend_name):
    return make_module_engine(model_path=str(tiny_llama_dir), max_total_tokens=16384,
                              grammar_backend=backend_name, grammar_compile_timeout=COMPILE_LIMIT_S)


@pytest.fixture(scope="module")
def eng_nojump(make_module_engine, tiny_llama_dir, backend_name):
    return make_module_engine(model_path=str(tiny_llama_dir), max_total_tokens=8192,
                              disable_jump_forward=True, grammar_backend=backend_name,
                              grammar_compile_timeout=COMPILE_LIMIT_S)


@pytest.fixture(scope="module")
def backend(eng):
    return create_grammar_backend(eng.server_args.grammar_backend, eng.tokenizer,
                                  eng.model_config.vocab_size, eng.model_config.eos_token_ids)


def supported(backend, kind, spec) -> bool:
    """Whether ``backend`` says it can enforce this grammar (else it must refuse it)."""
    if kind not in backend.kinds:
        return False
    if kind == "json_schema":
        try:
            backend.check_schema(spec)
        except ValueError:
            return False
    return True


def _check_outputs(outs, kinds):
    finished = 0
    for out, (kind, spec) in zip(outs, kinds):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue  # ran out of max_new_tokens inside a free-text field
        finished += 1
        if kind == "regex":
            assert re.fullmatch(spec, out["text"]), (spec, out["text"])
        elif kind == "ebnf":
            oracle = dict(EBNFS)[spec]
            assert re.fullmatch(oracle, out["text"]), (spec, out["text"])
        else:
            jsonschema.validate(json.loads(out["text"]), spec)
    return finished


def test_the_suite_is_large_enough():
    assert len(SCHEMAS) >= 30 and len(REGEXES) >= 15 and len(EBNFS) >= 3


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_sampled_outputs_match_their_grammar(eng, backend, seed):
    kinds = ([("json_schema", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES]
             + [("ebnf", g) for g, _ in EBNFS])
    kinds = [(k, spec) for k, spec in kinds if supported(backend, k, spec)]
    assert len(kinds) >= 35, backend.name  # a backend may skip only a few, by name
    params = [{"max_new_tokens": 96, "temperature": 1.0, "seed": seed + i, kind: spec}
              for i, (kind, spec) in enumerate(kinds)]
    outs = eng.generate(["Answer:"] * len(kinds), params)
    assert _check_outputs(outs, kinds) >= len(kinds) // 2


def test_unsupported_grammars_are_refused_not_run(eng, backend):
    refused = [(k, spec) for k, spec in [("json_schema", s) for s in SCHEMAS]
               + [("ebnf", g) for g, _ in EBNFS] if not supported(backend, k, spec)]
    for kind, spec in refused:
        with pytest.raises(ValueError, match=backend.name):
            eng.generate("x", {"max_new_tokens": 4, kind: spec})


def test_jump_forward_on_and_off_valid(eng, eng_nojump):
    sp = {"max_new_tokens": 160, "temperature": 0.7, "json_schema": LONG_KEYS_SCHEMA}
    kinds = [("json_schema", LONG_KEYS_SCHEMA)] * 4
    for e in (eng, eng_nojump):
        before = e.get_server_info()
        outs = e.generate(["Customer record:"] * 4, [{**sp, "seed": i} for i in range(4)])
        assert _check_outputs(outs, kinds) == 4
        jumped = e.get_server_info()["jump_forward_tokens"] - before["jump_forward_tokens"]
        assert (jumped > 0) == (e is eng)


def test_greedy_equals_hand_masked_run(eng_nojump, backend, tiny_llama_dir):
    """No jump-forward, greedy: the engine's tokens equal an unconstrained transformers run
    whose logits are masked by hand with the same backend's masks."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    vocab = eng_nojump.model_config.vocab_size
    cases = [("json_schema", SCHEMAS[6]), ("regex", REGEXES[5]), ("json_schema", SCHEMAS[0])]
    cases += [("ebnf", EBNFS[1][0])] if "ebnf" in backend.kinds else []
    for kind, spec in cases:
        prompt = eng_nojump.tokenizer.encode("Data:", add_special_tokens=False)
        out = eng_nojump.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 40, "temperature": 0, kind: spec})
        matcher = backend.compile(kind, canonical_spec(kind, spec)).new_matcher()
        ids, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(40):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                bitmask = allocate_token_bitmask(1, vocab)
                matcher.fill_bitmask(bitmask, 0)
                allowed = torch.tensor(allowed_ids(bitmask[0], vocab))
                masked = torch.full_like(logits, float("-inf"))
                masked[allowed] = logits[allowed]
                tok = int(masked.argmax())
                expected.append(tok)
                assert matcher.accept_token(tok)
                if matcher.is_terminated():
                    break
                ids.append(tok)
        assert out["output_ids"] == expected, (kind, out["output_ids"], expected)


def test_forced_tokens_obey_stops_and_length(eng, backend):
    """Text a grammar forces is checked like sampled text: a stop string inside it ends
    the request there, and max_new_tokens cuts it."""
    base = {"temperature": 0, "json_schema": LONG_KEYS_SCHEMA, "max_new_tokens": 200}
    out = eng.generate("Customer record:", {**base, "stop": ["preferred"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "preferred"}
    assert "preferred" not in out["text"] and out["text"].startswith("{")
    out = eng.generate("Customer record:", {**base, "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 3 == len(out["output_ids"])


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
    ("regex", "([a-z]", "regex"),
    ("json_schema", "{not json", "JSON"),
    ("json_schema", _deep_schema(10_000), "deep"),
    ("json_schema", [1, 2], "object"),
    ("json_schema", {"type": "object", "properties": [1]}, "properties"),
    ("json_schema", {"type": "array", "uniqueItems": True}, "uniqueItems"),
    ("json_schema", {"not": {"type": "integer"}}, "'not'"),
    ("ebnf", 'root ::= "unclosed', "ebnf"),
    ("ebnf", "root ::= missing_rule", "ebnf"),
    ("regex", 5, "regex: Input should be a valid string"),
])
def test_bad_grammars_are_value_errors(eng, field, spec, match):
    with pytest.raises(ValueError, match=match):
        eng.generate("x", {"max_new_tokens": 8, field: spec})
    # the engine keeps serving
    assert eng.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("field", ["regex", "json_schema", "ebnf"])
def test_an_empty_grammar_is_no_grammar(eng, field):
    # as in SGLang: "" for a grammar field means unconstrained
    sp = {"max_new_tokens": 6, "temperature": 0}
    want = eng.generate("Hello", sp)["output_ids"]
    assert eng.generate("Hello", {**sp, field: ""})["output_ids"] == want


def test_outlines_refuses_what_it_cannot_enforce(make_engine, tiny_llama_dir):
    eng = make_engine(model_path=str(tiny_llama_dir), max_total_tokens=2048,
                      grammar_backend="outlines")
    for spec, match in [({"type": "integer", "maximum": 9}, "'maximum'"),
                        ({"type": "object", "properties": {"a": {"type": "integer",
                                                                 "minimum": 1}}},
                         "minimum' at #/properties/a")]:
        with pytest.raises(ValueError, match=match):
            eng.generate("x", {"max_new_tokens": 8, "json_schema": spec})
    with pytest.raises(ValueError, match="outlines grammar backend cannot enforce 'ebnf'"):
        eng.generate("x", {"max_new_tokens": 8, "ebnf": EBNFS[0][0]})


def test_pathological_regex_is_bounded(eng):
    out = eng.generate("x", {"max_new_tokens": 16, "temperature": 0, "regex": "(a+)+b"})
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch("(a+)+b", out["text"])


def test_two_grammars_rejected(eng):
    with pytest.raises(ValueError, match="only one of regex, json_schema and ebnf"):
        eng.generate("x", {"max_new_tokens": 4, "regex": "a", "json_schema": {"type": "integer"}})
    with pytest.raises(ValueError, match="only one of"):
        eng.generate("x", {"max_new_tokens": 4, "regex": "a", "ebnf": 'root ::= "a"'})
