"""``separate_reasoning``: split a reasoning model's output into its thinking and its answer.

Reasoning models write their thinking between markers (``<think> ... </think>``) before the
answer. ``REASONING_FORMATS`` names the models by SGLang's reasoning-parser names; a
``forced`` format thinks from the first token, without an opening marker (DeepSeek-R1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool  # reasoning starts at once, with or without the start marker


_THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, forced=True),
    "step3": ReasoningFormat(*_THINK, forced=True),
    "qwen3": ReasoningFormat(*_THINK, forced=False),
    "qwen3-thinking": ReasoningFormat(*_THINK, forced=True),
    "nanbeige": ReasoningFormat(*_THINK, forced=False),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", forced=False),
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    key = (model_type or "").lower()
    if key not in REASONING_FORMATS:
        raise ValueError(
            f"separate_reasoning(model_type={model_type!r}): unknown model type; "
            f"known: {sorted(REASONING_FORMATS)}"
        )
    return REASONING_FORMATS[key]


def split_reasoning(text: str, model_type: str | None) -> tuple[str, str]:
    """(reasoning, answer) of ``text``. Reasoning cut short before its end marker is all
    reasoning; text with no reasoning (and a format that is not forced) is all answer."""
    fmt = reasoning_format(model_type)
    if not fmt.forced and fmt.start not in text:
        return "", text
    i = len(text) - len(text.lstrip())
    while text.startswith(fmt.start, i):  # (not a copy per marker: linear in the text)
        i += len(fmt.start)
    body = text[i:]
    if fmt.end not in body:
        return body, ""
    reasoning, answer = body.split(fmt.end, 1)
    return reasoning, answer
