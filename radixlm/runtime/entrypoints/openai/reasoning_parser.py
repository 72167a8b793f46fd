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
from radixlm.runtime.entrypoints.openai.function_call.scan import (
    Finder,
    Run,
    TrailingSpace,
    held,
)

THINK_START, THINK_END = "<think>", "</think>"
_FORCED = {"deepseek-r1"}
_ANALYSIS = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>")
_ANALYSIS_MARKERS = ("<|start|>assistant<|channel|>analysis<|message|>",
                     "<|channel|>analysis<|message|>")
_ANALYSIS_END = "<|end|>"


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
    """Splits one choice's output into (reasoning, content).

    Streamed, it reads each delta once: the text before ``pos`` is settled, markers are
    looked for in the new text only (``function_call/scan.py``), so a stream is linear in
    its length."""

    def __init__(self, name: str, in_reasoning: bool = False) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}"
                             f", got {name!r}")
        self.name = name
        self.in_reasoning = in_reasoning
        self.buffer = ""
        self.sent = [0, 0]  # <think>: where reasoning and content were given up to
        # <think>: the leading whitespace, then where the thinking starts (-1: no thinking)
        self.lead = Run(0)
        self.body: int | None = None
        self.first: Run | None = None  # the thinking's first non-space
        self.tail: TrailingSpace | None = None
        self.end: Finder | None = None
        self.after: Run | None = None
        # harmony: the text before pos is split; an analysis message is open from body
        self.pos = 0
        self.search_from = 0
        self.in_analysis = False

    def parse(self, text: str) -> tuple[str | None, str]:
        reader = ReasoningParser(self.name, self.in_reasoning)
        reader.buffer = text
        reasoning, content = reader._diff(final=True)
        return reasoning or None, content

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.buffer = self.buffer, ""
        text += delta  # the only reference: CPython grows the string in place, no copy
        self.buffer = text
        return self._diff(final=False)

    def finish(self) -> tuple[str, str]:
        return self._diff(final=True)

    def _diff(self, final: bool) -> tuple[str, str]:
        if self.name == "gpt-oss":
            return self._harmony(final)
        reasoning, content = self._think(self.buffer, final)
        out = []
        for i, (a, b) in enumerate((reasoning, content)):
            out.append(self.buffer[a + self.sent[i]:b] if b - a > self.sent[i] else "")
            self.sent[i] = max(self.sent[i], b - a)
        return out[0], out[1]

    def _think(self, text: str, final: bool) -> tuple[tuple[int, int], tuple[int, int]]:
        """The spans of (reasoning, content) settled so far."""
        none = (0, 0)
        if self.body is None:
            start = self.lead.skip(text)
            if text.startswith(THINK_START, start):
                self.body = start + len(THINK_START)
            elif not final and len(text) - start < len(THINK_START) and THINK_START.startswith(
                    text[start:]):
                return none, none  # may still become <think>
            elif self.in_reasoning:
                self.body = start
            else:
                self.body = -1
        if self.body < 0:
            return none, (0, len(text))
        if self.end is None:
            self.first, self.tail = Run(self.body), TrailingSpace(self.body)
            self.end = Finder(THINK_END, self.body)
        end = self.end.find(text)
        if end < 0:
            stop = len(text) if final else len(text) - held(text, self.body, (THINK_END,))
            return self._strip(text, stop), none
        self.after = self.after or Run(end + len(THINK_END))
        return self._strip(text, end), (self.after.skip(text), len(text))

    def _strip(self, text: str, stop: int) -> tuple[int, int]:
        """The span of ``text[body:stop].strip()``."""
        end = self.tail.rstrip_end(text, stop)
        return (self.first.skip(text), end) if end > self.body else (0, 0)

    def _harmony(self, final: bool) -> tuple[str, str]:
        """The analysis messages' bodies are the reasoning; the rest is content."""
        text, reasoning, content = self.buffer, [], []
        while True:
            if not self.in_analysis:
                m = _ANALYSIS.search(text, max(self.pos, self.search_from))
                if m is None:
                    stop = len(text) if final else len(text) - held(text, self.pos,
                                                                      _ANALYSIS_MARKERS)
                    self.search_from = len(text) - len(_ANALYSIS_MARKERS[0]) + 1
                    content.append(text[self.pos:stop])
                    self.pos = stop
                    break
                content.append(text[self.pos:m.start()])
                self.pos, self.in_analysis = m.end(), True
                self.end = Finder(_ANALYSIS_END, self.pos)
            end = self.end.find(text)
            if end < 0:
                stop = len(text) if final else len(text) - held(text, self.pos,
                                                                  (_ANALYSIS_END,))
                reasoning.append(text[self.pos:stop])
                self.pos = stop
                break
            reasoning.append(text[self.pos:end])
            self.pos, self.in_analysis = end + len(_ANALYSIS_END), False
        return "".join(reasoning), "".join(content)
