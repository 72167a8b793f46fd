"""--reasoning-parser on text: whole and streamed at every split point agree."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from radixlm.runtime.constrained import (
    allocate_token_bitmask,
    allowed_ids,
    canonical_spec,
    create_grammar_backend,
)
from radixlm.runtime.constrained.after_text import AfterTextMatcher
from radixlm.runtime.entrypoints.openai.chat_output import ChoiceOutput
from radixlm.runtime.entrypoints.openai.function_call import ToolCallParser, tool_call_format
from radixlm.runtime.entrypoints.openai.reasoning_parser import (
    ReasoningParser,
    prompt_opens_thinking,
    starts_in_reasoning,
)

CASES = [
    # (parser, prompt opens <think>, output, reasoning, content)
    ("qwen3", False, "<think>\nPlan it.\n</think>\n\nThe answer.", "Plan it.", "The answer."),
    ("qwen3", False, "No thinking here.", None, "No thinking here."),
    ("qwen3", True, "Plan it.</think>Answer", "Plan it.", "Answer"),
    ("qwen3", True, "Still thinking when cut", "Still thinking when cut", ""),
    ("deepseek-r1", False, "R1 skips the tag</think>\n\nAnswer", "R1 skips the tag", "Answer"),
    ("gpt-oss", False, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
                       "<|channel|>final<|message|>Hi<|return|>", "Think.",
     "<|start|>assistant<|channel|>final<|message|>Hi<|return|>"),
]


def _stream(parser: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str]:
    bounds = [0, *cuts, len(text)]
    parts = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize("name, opens, text, reasoning, content", CASES)
def test_split(name, opens, text, reasoning, content):
    opens = starts_in_reasoning(name, "<|im_start|>assistant\n" + ("<think>\n" if opens else ""))
    assert ReasoningParser(name, opens).parse(text) == (reasoning, content)
    for cut in range(1, len(text)):
        assert _stream(ReasoningParser(name, opens), text, [cut]) == (reasoning or "", content)
    assert _stream(ReasoningParser(name, opens), text, list(range(1, len(text)))) == (
        reasoning or "", content)


def test_prompt_opens_thinking():
    assert starts_in_reasoning("deepseek-r1", "assistant\n")
    assert not starts_in_reasoning("deepseek-r1", "assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("qwen3", "assistant\n")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_unknown_name():
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ReasoningParser("nope")


def test_thinking_then_a_call_streams_as_the_whole_message():
    def new() -> ChoiceOutput:
        return ChoiceOutput(ReasoningParser("qwen3"), ToolCallParser(tool_call_format("qwen25")))

    text = ('<think>Need <tool_call> weather.</think>\n\nChecking. <tool_call>\n'
            '{"name": "w", "arguments": {"c": "P"}}\n</tool_call>')
    whole = new().message(text)
    assert whole["reasoning_content"] == "Need <tool_call> weather."
    assert whole["content"] == "Checking."
    [call] = whole["tool_calls"]
    assert call["function"] == {"name": "w", "arguments": '{"c": "P"}'}
    for cut in range(1, len(text)):
        out = new()
        parts = [out.delta(text[:cut]), out.delta(text[cut:], final=True)]
        got = {"reasoning_content": "", "content": "", "arguments": "", "names": []}
        for p in parts:
            got["reasoning_content"] += p.get("reasoning_content", "")
            got["content"] += p.get("content", "")
            for c in p.get("tool_calls", []):
                got["arguments"] += c["function"]["arguments"]
                got["names"] += [c["function"]["name"]] if "name" in c["function"] else []
        assert got == {"reasoning_content": whole["reasoning_content"],
                       "content": "Checking. ", "arguments": '{"c": "P"}', "names": ["w"]}, cut


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_grammar_holds_only_the_answer_after_thinking(tiny_qwen2_dir, backend):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    be = create_grammar_backend(backend, tok, len(tok))
    grammar = be.compile("json_schema", canonical_spec("json_schema", {"enum": [7]}))
    m = AfterTextMatcher(grammar.new_matcher(), "</think>", tok)
    row = allocate_token_bitmask(1, len(tok))
    for t in tok.encode("any {thinking} at all </think>"):
        m.fill_bitmask(row, 0)
        assert len(allowed_ids(row[0], len(tok))) == len(tok) and m.forced_string() == ""
        assert m.accept_token(t) and not m.is_terminated()
    assert m.started
    assert not m.accept_token(tok.encode("x")[0])  # the answer is held to the grammar
    assert m.accept_token(tok.encode("7")[0]) and m.is_accepting()
    m.rollback(2)  # back over the marker's last token: free again
    assert not m.started and m.accept_token(tok.encode("x")[0])


def test_stream_reasoning_false_sends_the_thinking_in_one_delta():
    out = ChoiceOutput(ReasoningParser("qwen3"), None, stream_reasoning=False)
    deltas = [out.delta(p) for p in ("<think>a", " b", "</think>", "\n\nAns", "wer")]
    deltas.append(out.delta("", final=True))
    assert [d for d in deltas if d] == [{"reasoning_content": "a b", "content": "Ans"},
                                        {"content": "wer"}]
