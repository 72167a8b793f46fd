"""One generic parser over any ``ToolCallFormat``: the whole text at once, or a stream.

    parser = ToolCallParser(fmt)
    content, calls = parser.parse(text)              # non-streaming
    for delta in stream: events = parser.feed(delta)  # streaming: TextDelta / CallDelta
    events = parser.finish()                         # the output ended

Both read the text the same way (``ToolCallParser._advance``): ordinary text up to a
trigger, then the format's call region. While streaming, text that could still be the
start of a trigger is held back, and a call's arguments are sent as they grow (each
delta extends the last), so the deltas reassemble to exactly what ``parse`` returns for
the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.entrypoints.openai.function_call.core import (
    PartialCall,
    Region,
    RegionParse,
    ToolCall,
    ToolCallFormat,
    new_call_id,
)
from radixlm.runtime.entrypoints.openai.function_call.scan import TextMemo


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


class ToolCallParser:
    """Tool calls and ordinary text of one choice's output, whole or streamed.

    The text before ``pos`` is settled (ordinary text given out, or calls); an unfinished
    call region is read again, going on from where it stopped, as the text grows. Each
    delta costs what is new in it, so a stream is linear in its length."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None) -> None:
        """``max_calls``: calls past it are dropped (``parallel_tool_calls: false``)."""
        self.fmt = fmt
        self.max_calls = max_calls
        self.buffer = ""
        self.pos = 0
        self.region: Region | None = None
        self.memo = TextMemo()  # shared by the regions
        self.region_text = 0  # the open region's ordinary text was given up to here
        self.current = RegionParse()  # the open region's last reading
        self.calls: list[PartialCall] = []  # of the regions that ended
        self.next_at = dict.fromkeys(fmt.triggers, -1)  # a trigger's next place, if >= pos
        self.search_from = dict.fromkeys(fmt.triggers, 0)
        self.waiting: list[str] = []  # whitespace after a call, sent with the next text
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content None when only calls remain."""
        reader = ToolCallParser(self.fmt, self.max_calls)
        reader.buffer = text
        normal = "".join(reader._advance(final=True))
        calls = [ToolCall(c.name, c.arguments or "{}") for c in reader._calls_from(0, True)
                 if c.name is not None]
        content = normal.strip() if calls else normal
        return (content or None) if calls else content, calls

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The new text delta and call deltas after ``delta`` arrived."""
        text, self.buffer = self.buffer, ""
        text += delta  # the only reference: CPython grows the string in place, no copy
        self.buffer = text
        return self._diff(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What the end of the output settles (held-back text, the last call)."""
        return self._diff(final=True)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _next_trigger(self, text: str) -> int:
        """Where the first trigger at or after ``pos`` starts, -1 if none does yet."""
        best = -1
        for t in self.fmt.triggers:
            at = self.next_at[t]
            if at < self.pos:
                at = text.find(t, max(self.pos, self.search_from[t]))
                if at < 0:  # one may still straddle the end
                    self.search_from[t] = len(text) - len(t) + 1
                self.next_at[t] = at
            if at >= 0 and (best < 0 or at < best):
                best = at
        return best

    def _advance(self, final: bool) -> list[str]:
        """The ordinary text settled since the last call, in pieces; calls are kept."""
        text, out = self.buffer, []
        while True:
            if self.region is None:
                start = self._next_trigger(text)
                if start < 0:
                    tail = text[max(self.pos, len(text) - self.longest_trigger):]
                    keep = len(text) if final else len(text) - _held_prefix(tail, self.fmt.triggers)
                    out.append(text[self.pos:keep])
                    self.pos = keep
                    return out
                out.append(text[self.pos:start])
                self.region, self.region_text = self.fmt.region(text, start, self.memo), start
            start = self.region.start
            r = self.region.parse(text, final)
            if r.end == -1:  # not a call: its first character is text, look again after it
                out.append(text[start])
                self.pos, self.region, self.current = start + 1, None, RegionParse()
                continue
            if r.text is not None and r.text[1] > self.region_text:
                out.append(text[max(r.text[0], self.region_text):r.text[1]])
                self.region_text = r.text[1]
            self.current = r
            if r.end is None:  # unfinished: nothing after it is settled yet
                return out
            self.calls += r.calls
            self.pos, self.region, self.current = r.end, None, RegionParse()

    @property
    def longest_trigger(self) -> int:
        return max(map(len, self.fmt.triggers))

    def _calls_from(self, first: int, final: bool) -> list[PartialCall]:
        """The calls from index ``first`` on (at most ``max_calls``); at the end, whole ones."""
        cur, settled = self.current, len(self.calls)
        stop = settled + len(cur.calls) + 1 if self.max_calls is None else self.max_calls
        calls = self.calls[first:stop]
        if stop > settled:
            calls += cur.calls[max(0, first - settled):stop - settled]
            if cur.open_call is not None:
                calls.append(cur.open_call)
        if final:
            calls = [c for c in calls if c.done]
        return calls[:max(0, stop - first)]

    def _send(self, pieces: list[str], final: bool) -> str:
        """The text to send now; after a call, whitespace waits for more text (or the end,
        where whitespace alone is dropped)."""
        new = "".join(pieces)
        if not self.ids:
            return new
        if not final and (not new or new.isspace()):
            if new:
                self.waiting.append(new)
            return ""
        text = "".join(self.waiting) + new
        if final:
            self.waiting = []
            return text if text.strip() else ""
        keep = len(text.rstrip())
        self.waiting = [text[keep:]]
        return text[:keep]

    def _diff(self, final: bool) -> tuple[str, list[CallDelta]]:
        text = self._send(self._advance(final), final)
        out: list[CallDelta] = []
        first = max(0, len(self.ids) - 1)  # the calls before it are whole and sent
        for i, call in enumerate(self._calls_from(first, final), start=first):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append(CallDelta(i, "", id=self.ids[i], name=call.name))
            if final and not call.args_length():
                call = PartialCall(call.name, "{}", done=True)
            if call.args_length() > self.sent_args[i]:
                out.append(CallDelta(i, call.args_from(self.buffer, self.sent_args[i])))
                self.sent_args[i] = call.args_length()
        return text, out
