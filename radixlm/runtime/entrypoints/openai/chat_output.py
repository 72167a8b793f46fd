"""One chat choice's output as OpenAI shows it: reasoning, content and tool calls.

The text goes through the reasoning parser (if any) and its content through the tool-call
parser (if any). ``message`` gives the fields of a whole response's ``message``;
``delta`` / ``finish`` give the stream's delta fields for each new piece of text.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.entrypoints.openai.function_call import ToolCallParser
from radixlm.runtime.entrypoints.openai.reasoning_parser import ReasoningParser


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 drop_calls: bool = False, stream_reasoning: bool = True) -> None:
        """``drop_calls``: the tool parser only reads the text (harmony without tools);
        ``stream_reasoning`` false (SGLang's): the reasoning is held until it ends."""
        self.reasoning = reasoning
        self.tools = tools
        self.drop_calls = drop_calls
        self.stream_reasoning = stream_reasoning
        self.held_reasoning: list[str] = []  # joined once: a string grown per delta is quadratic

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called and not self.drop_calls

    def message(self, text: str) -> dict[str, Any]:
        """``message`` fields (role excluded) of the whole output ``text``."""
        out: dict[str, Any] = {}
        if self.reasoning is not None:
            out["reasoning_content"], text = self.reasoning.parse(text)
        content: str | None = text
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            if calls and not self.drop_calls:
                out["tool_calls"] = [c.to_openai() for c in calls]
                self.tools.ids = [c.id for c in calls]  # marks the choice as called
        return {"content": content, **out}

    def _fields(self, reasoning: str, content: str, calls: list) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls and not self.drop_calls:
            merged: list[dict[str, Any]] = []
            for c in calls:  # one entry per call in a chunk: id and name with arguments
                d = c.to_openai()
                if merged and merged[-1]["index"] == c.index:
                    merged[-1]["function"]["arguments"] += d["function"]["arguments"]
                else:
                    merged.append(d)
            out["tool_calls"] = merged
        return out

    def delta(self, text: str, final: bool = False) -> dict[str, Any]:
        """Delta fields for the new piece ``text`` (empty: nothing to show yet);
        ``final``: the output ends with it, so held-back text and the last call settle."""
        reasoning, content, calls = "", text, []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_r, more_c = self.reasoning.finish()
                reasoning, content = reasoning + more_r, content + more_c
            if not self.stream_reasoning:
                self.held_reasoning.append(reasoning)
                reasoning = ""
                if content or final:  # the thinking is over
                    reasoning, self.held_reasoning = "".join(self.held_reasoning), []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                more, tail = self.tools.finish()
                content, calls = content + more, calls + tail
        return self._fields(reasoning, content, calls)
