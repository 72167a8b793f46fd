"""One generic parser over any ``ToolCallFormat``: the whole text at once, or a stream.

    parser = ToolCallParser(fmt)
    content, calls = parser.parse(text)              # non-streaming
    for delta in stream: events = parser.feed(delta)  # streaming: TextDelta / CallDelta
    events = parser.finish()                         # the output ended

Both read the text with the same ``analyse``: ordinary text up to a trigger, then the
format's call region. While streaming, text that could still be the start of a trigger is
held back, and a call's arguments are sent as they grow (each delta extends the last), so
the deltas reassemble to exactly what ``parse`` returns for the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.entrypoints.openai.function_call.core import (
    NOT_A_CALL,
    PartialCall,
    ToolCall,
    ToolCallFormat,
    new_call_id,
)


@dataclass
class CallDelta:
    """OpenAI's ``delta.tool_calls[i]``: id, type and name first, then argument pieces."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn = {"name": self.name, **fn}
        out["function"] = fn
        return out


def _held_prefix(tail: str, triggers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``tail`` that is a proper prefix of a trigger."""
    best = 0
    for t in triggers:
        for k in range(min(len(t) - 1, len(tail)), best, -1):
            if tail.endswith(t[:k]):
                best = k
                break
    return best


def analyse(fmt: ToolCallFormat, text: str, final: bool) -> tuple[str, list[PartialCall]]:
    """The ordinary text settled so far and the calls, from the start of ``text``."""
    normal: list[str] = []
    calls: list[PartialCall] = []
    pos = 0
    while True:
        found = [(i, t) for t in fmt.triggers if (i := text.find(t, pos)) >= 0]
        if not found:
            tail = text[pos:]
            keep = len(tail) if final else len(tail) - _held_prefix(tail, fmt.triggers)
            normal.append(tail[:keep])
            return "".join(normal), calls
        start = min(found)[0]
        normal.append(text[pos:start])
        region = fmt.parse_region(text[start:], final)
        if region is NOT_A_CALL or region.end == -1:
            normal.append(text[start])
            pos = start + 1
            continue
        normal.append(region.text)
        calls += region.calls
        if region.end is None:  # unfinished: nothing after it is settled yet
            return "".join(normal), calls
        pos = start + region.end


class ToolCallParser:
    """Tool calls and ordinary text of one choice's output, whole or streamed."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None) -> None:
        """``max_calls``: calls past it are dropped (``parallel_tool_calls: false``)."""
        self.fmt = fmt
        self.max_calls = max_calls
        self.buffer = ""
        self.sent_text = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content None when only calls remain."""
        normal, partial = analyse(self.fmt, text, final=True)
        calls = [ToolCall(c.name, c.arguments or "{}") for c in partial
                 if c.done and c.name is not None][:self.max_calls]
        content = normal.strip() if calls else normal
        return (content or None) if calls else content, calls

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The new text delta and call deltas after ``delta`` arrived."""
        self.buffer += delta
        return self._diff(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What the end of the output settles (held-back text, the last call)."""
        return self._diff(final=True)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _diff(self, final: bool) -> tuple[str, list[CallDelta]]:
        normal, partial = analyse(self.fmt, self.buffer, final)
        if final:
            partial = [c for c in partial if c.done]
        text = normal[self.sent_text:] if len(normal) > self.sent_text else ""
        if self.ids and not final:  # after a call, whitespace waits for more text
            text = text[:len(text.rstrip())]
        self.sent_text += len(text)
        if self.ids and final and not text.strip():
            text = ""
        out: list[CallDelta] = []
        for i, call in enumerate(partial[:self.max_calls]):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append(CallDelta(i, "", id=self.ids[i], name=call.name))
            args = call.arguments if not (final and not call.arguments) else "{}"
            if len(args) > self.sent_args[i]:
                out.append(CallDelta(i, args[self.sent_args[i]:]))
                self.sent_args[i] = len(args)
        return text, out
