"""plan_tools: the request checks, and the grammars that hold calls to their schemas
(compiled by xgrammar and llguidance over the tiny model's tokenizer)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from radixlm.runtime.constrained import canonical_spec, create_grammar_backend
from radixlm.runtime.entrypoints.openai.chat_prompt import constrain
from radixlm.runtime.entrypoints.openai.function_call import plan_tools
from radixlm.runtime.entrypoints.openai.function_call.json_array import forced_schema
from radixlm.runtime.managers.api_error import ApiError

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer"}},
        "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "noop"}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def _accepts(tokenizer, backend: str, kind: str, spec, text: str) -> bool:
    be = create_grammar_backend(backend, tokenizer, len(tokenizer))
    matcher = be.compile(kind, canonical_spec(kind, spec)).new_matcher()
    ok = all(matcher.accept_token(t) for t in tokenizer.encode(text))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("parser", ["qwen25", "llama3", "mistral"])
def test_auto_holds_each_call_to_its_schema(tokenizer, backend, parser):
    plan = plan_tools(TOOLS, "auto", None, parser)
    kind, spec = plan.constraint()
    assert kind == "structural_tag"
    begin, end = plan.fmt.structure("weather")
    good = f'Let me look. {begin}{{"city": "Oslo", "days": 2}}{end} done'
    assert _accepts(tokenizer, backend, kind, spec, good)
    content, calls = plan.new_parser().parse(good)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo", "days": 2})]
    for bad in (f'{begin}{{"city": 3}}{end}', f'{begin}{{"days": 2}}{end}',
                begin.replace("weather", "other")):
        assert not _accepts(tokenizer, backend, kind, spec, bad), bad


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_required_is_an_array_of_allowed_calls(tokenizer, backend):
    kind, spec = plan_tools(TOOLS, "required", None, None).constraint()
    good = '[{"name": "weather", "parameters": {"city": "Lima"}}, {"name": "noop", ' \
           '"parameters": {}}]'
    assert kind == "json_schema" and _accepts(tokenizer, backend, kind, spec, good)
    assert not _accepts(tokenizer, backend, kind, spec, '[{"name": "weather", '
                                                        '"parameters": {"days": 1}}]')
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "noop"}}, None,
                       None).constraint()[1]
    assert not _accepts(tokenizer, backend, "json_schema", named, good)
    one = plan_tools(TOOLS, "required", False, None).constraint()[1]
    assert not _accepts(tokenizer, backend, "json_schema", one, good)


def test_refs_are_hoisted():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
              "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                              "required": ["x"]}}}
    schema = forced_schema([("f", params), ("g", CITY)], parallel=True)
    jsonschema.validate([{"name": "f", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": {"x": "1"}}}], schema)


@pytest.mark.parametrize("kwargs, param, word", [
    (dict(tools=TOOLS), "tool_choice", "--tool-call-parser"),
    (dict(tools=None, functions=[TOOLS[0]["function"]]), "function_call",
     "--tool-call-parser"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "one of"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice", "not among"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}],
          tool_choice="required"), "tools[0].function.name", "letters"),
    (dict(tools=[TOOLS[0], TOOLS[0]], tool_choice="required"), "tools", "same name"),
    (dict(tools=None, tool_choice="required"), "tool_choice", "only allowed"),
])
def test_bad_requests_name_the_field(kwargs, param, word):
    tools = kwargs.pop("tools")
    choice = kwargs.pop("tool_choice", None)
    with pytest.raises(ApiError) as e:
        plan_tools(tools, choice, None, None, **kwargs)
    assert e.value.param == param and word in str(e.value), str(e.value)


def test_none_renders_but_neither_constrains_nor_parses():
    plan = plan_tools(TOOLS, "none", None, "qwen25")
    assert plan.template_tools[0]["function"]["name"] == "weather"
    assert plan.constraint() is None and plan.new_parser() is None
    assert plan_tools(None, None, None, None) is None


@pytest.mark.parametrize("spec, word", [
    ({"structures": [], "triggers": ["<a>"]}, "structures"),
    ({"structures": [{"begin": "<b>", "schema": {}, "end": ""}], "triggers": ["<a>"]},
     "does not start with any trigger"),
    ({"structures": [{"begin": "<a>", "end": ""}], "triggers": ["<a>"]}, "schema"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": [""]},
     "non-empty"),
    ({"structures": [{"begin": "<a>", "schema": 3, "end": ""}], "triggers": ["<a>"]},
     "json_schema"),
    ("{not json", "not valid JSON"),
])
def test_structural_tag_spec_errors(spec, word):
    with pytest.raises(ValueError, match=word):
        canonical_spec("structural_tag", spec)


def test_special_token_formats_keep_special_tokens():
    for parser, keep in (("pythonic", True), ("llama3", True), ("qwen25", False)):
        sp: dict = {}
        constrain(plan_tools(TOOLS, "auto", None, parser), sp)
        assert sp.get("skip_special_tokens", True) is not keep, parser
    sp = {}
    constrain(plan_tools(TOOLS, "required", None, "llama3"), sp)
    assert "skip_special_tokens" not in sp and "json_schema" in sp


def test_a_call_that_begins_with_a_special_token_is_parsed_not_held():
    plan = plan_tools(TOOLS, "auto", None, "mistral")
    assert plan.constraint(frozenset({"[TOOL_CALLS]"})) is None
    assert plan.constraint(frozenset({"<|im_end|>"}))[0] == "structural_tag"
    assert plan_tools(TOOLS, "auto", None, "llama3").constraint(
        frozenset({"<|python_tag|>"}))[0] == "structural_tag"  # its JSON form is held


def test_response_format_beside_tools():
    """A forced call is held to the calls' grammar (the format is for later turns' text);
    under auto the text is held to the format (vLLM's rule), not to the tools' tag."""
    fmt = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    for choice in ("required", {"type": "function", "function": {"name": TOOLS[0][
            "function"]["name"]}}):
        sp = {"json_schema": json.dumps(fmt)}
        constrain(plan_tools(TOOLS, choice, None, "qwen25"), sp)
        assert sp["json_schema"] != json.dumps(fmt) and "structural_tag" not in sp
    sp = {"json_schema": json.dumps(fmt)}
    constrain(plan_tools(TOOLS, "auto", None, "qwen25"), sp)
    assert sp == {"json_schema": json.dumps(fmt)}
    sp = {}
    constrain(plan_tools(TOOLS, "auto", None, "qwen25"), sp)
    assert "structural_tag" in sp
