"""--reasoning-parser on text: whole and streamed at every split point agree."""

from __future__ import annotations

import pytest

from radixlm.runtime.entrypoints.reasoning_parser import ReasoningParser, prompt_opens_thinking

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
    assert ReasoningParser(name, opens).parse(text) == (reasoning, content)
    for cut in range(1, len(text)):
        assert _stream(ReasoningParser(name, opens), text, [cut]) == (reasoning or "", content)
    assert _stream(ReasoningParser(name, opens), text, list(range(1, len(text)))) == (
        reasoning or "", content)


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_unknown_name():
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ReasoningParser("nope")


def test_thinking_then_a_call_streams_as_the_whole_message():
    from radixlm.runtime.entrypoints.chat_output import ChoiceOutput
    from radixlm.runtime.entrypoints.function_call import ToolCallParser, tool_call_format

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
