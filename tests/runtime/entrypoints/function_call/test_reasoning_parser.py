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
