"""``--reasoning-parser``: a reasoning model's thinking, split from its answer.

    parser = ReasoningParser("qwen3", starts_in_reasoning("qwen3", prompt_text))
    reasoning, content = parser.parse(text)              # whole output
    r_delta, c_delta = parser.feed(delta); parser.finish()  # streamed

Names are SGLang's. ``qwen3`` / ``deepseek-r1`` (and ``deepseek-v3``, ``kimi``, ``glm45``,
which write the same tags): thinking is between ``<think>`` and ``</think>``. The output
starts inside the thinking when the prompt ends in an open ``<think>`` (templates that
open it for the model: DeepSeek-R1, Qwen3-2507 thinking) and for ``deepseek-r1`` always
(SGLang's force_reasoning: R1 may skip the opening tag); otherwise only if it starts with
``<think>``. Without ``</think>`` everything is thinking. ``gpt-oss``: the harmony
``analysis`` channel's messages are the thinking; the rest is left for the harmony text
and tool-call reader (``function_call/harmony.py``). Like the tool-call parser, both paths
read the text with one function, so streamed deltas add up to the whole-text split.
"""

from __future__ import annotations

import re

from radixlm.runtime.config_checks import REASONING_PARSERS

THINK_START, THINK_END = "<think>", "</think>"
_FORCED = {"deepseek-r1"}
_ANALYSIS = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>")
_ANALYSIS_MARKERS = ("<|start|>assistant<|channel|>analysis<|message|>",
                     "<|channel|>analysis<|message|>")
_ANALYSIS_END = "<|end|>"


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` open for the model."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def starts_in_reasoning(name: str, prompt: str) -> bool:
    """Whether the output of ``prompt`` starts inside the thinking: the prompt opens it,
    or the parser forces it (deepseek-r1) unless the prompt just closed it (thinking off)."""
    if name == "gpt-oss":
        return False
    if prompt_opens_thinking(prompt):
        return True
    return name in _FORCED and not prompt.rstrip().endswith(THINK_END)


class ReasoningParser:
    """Splits one choice's output into (reasoning, content)."""

    def __init__(self, name: str, in_reasoning: bool = False) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}"
                             f", got {name!r}")
        self.name = name
        self.in_reasoning = in_reasoning
        self.buffer = ""
        self.sent = [0, 0]

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) settled so far."""
        if self.name == "gpt-oss":
            return self._split_harmony(text, final)
        return self._split_think(text, final)

    def _split_think(self, text: str, final: bool) -> tuple[str, str]:
        start = len(text) - len(text.lstrip())
        if text.startswith(THINK_START, start):
            start += len(THINK_START)
        elif not self.in_reasoning:
            if not final and THINK_START.startswith(text[start:]):
                return "", ""  # may still become <think>
            return "", text
        end = text.find(THINK_END, start)
        if end < 0:
            body = text[start:]
            if not final:
                body = body[:len(body) - _held(body, (THINK_END,))].rstrip()
            return body.strip(), ""
        return text[start:end].strip(), text[end + len(THINK_END):].lstrip()

    def _split_harmony(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content, pos = [], [], 0
        while True:
            m = _ANALYSIS.search(text, pos)
            if m is None:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - _held(tail, _ANALYSIS_MARKERS)])
                break
            content.append(text[pos:m.start()])
            end = text.find(_ANALYSIS_END, m.end())
            if end < 0:
                body = text[m.end():]
                keep = len(body) if final else len(body) - _held(body, (_ANALYSIS_END,))
                reasoning.append(body[:keep])
                break
            reasoning.append(text[m.end():end])
            pos = end + len(_ANALYSIS_END)
        return "".join(reasoning), "".join(content)

    def parse(self, text: str) -> tuple[str | None, str]:
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        return self._diff(final=False)

    def finish(self) -> tuple[str, str]:
        return self._diff(final=True)

    def _diff(self, final: bool) -> tuple[str, str]:
        out = []
        for i, part in enumerate(self.split(self.buffer, final)):
            new = part[self.sent[i]:] if len(part) > self.sent[i] else ""
            self.sent[i] += len(new)
            out.append(new)
        return out[0], out[1]
