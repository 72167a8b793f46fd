"""The event stream of a streamed response, built from chat-completion chunk deltas.

The order is OpenAI's (and vLLM's):

    response.created, response.in_progress
    reasoning:    output_item.added, content_part.added (reasoning_text),
                  reasoning_text.delta*, reasoning_text.done, content_part.done,
                  output_item.done
    per message:  output_item.added, content_part.added, output_text.delta*,
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta*,
                  function_call_arguments.done, output_item.done
    response.completed | response.incomplete | response.failed (after an ``error`` event)

Each event is ``event: <type>`` plus ``data: <json>`` with a ``sequence_number`` counting
from 0; there is no ``[DONE]`` (the terminal response event ends the stream). The closing
events carry the whole response (every item, logprobs included): ``finish`` and ``fail``
encode in pieces (``http_utils.encode_json``), and ``Turn`` runs them on the JSON thread.
A stream costs what its length does: the text and arguments of open items are kept as
lists of deltas, joined once when the item closes (``_grow`` / ``_settle``), and each
item's output index is remembered, not searched for.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixlm.runtime.entrypoints.http_utils import encode_json
from radixlm.runtime.entrypoints.openai.responses_items import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
)


class ResponseEvents:
    """One stream's state: its next sequence number and its output items so far."""

    def __init__(self, response: dict[str, Any], want_logprobs: bool) -> None:
        self.response = response  # the response object (status, output, usage are set here)
        self.want_logprobs = want_logprobs
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> its open item
        self.closing = False  # finish / fail: the events carry the whole response
        # (id(holder), key) -> (holder, key, deltas not yet joined into holder[key])
        self._open: dict[tuple[int, str], tuple[dict[str, Any], str, list[str]]] = {}
        self._index: dict[int, int] = {}  # id(item) -> its output index

    def _add_item(self, item: dict[str, Any]) -> int:
        self._index[id(item)] = len(self.items)
        self.items.append(item)
        return len(self.items) - 1

    def _grow(self, holder: dict[str, Any], key: str, text: str) -> None:
        """``holder[key] += text``, kept as a list until ``_settle`` (no copy per delta)."""
        self._open.setdefault((id(holder), key), (holder, key, []))[2].append(text)

    def _settle(self, holder: dict[str, Any] | None = None, key: str = "") -> None:
        """Join the deltas of ``holder[key]`` (every open one when no holder is given)."""
        keys = list(self._open) if holder is None else [(id(holder), key)]
        for k in keys:
            if k in self._open:
                target, name, pieces = self._open.pop(k)
                target[name] += "".join(pieces)

    def event(self, kind: str, **fields: Any) -> bytes:
        encode = encode_json if self.closing else msgspec.json.encode
        data = encode({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": list(self.items)}

    def begin(self) -> list[bytes]:
        return [self.event("response.created", response=self._snapshot()),
                self.event("response.in_progress", response=self._snapshot())]

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None
              ) -> list[bytes]:
        """The events of one chat chunk's ``delta`` (and its ``logprobs.content``)."""
        events: list[bytes] = []
        thought = delta.get("reasoning_content")
        if thought:
            events += self._reasoning(thought)
        text = delta.get("content")
        if text:
            events += self._close_reasoning("completed") + self._text(text, logprobs or [])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        events = self._close_calls()
        if self.message is None:
            self.message = message_item(new_id("msg"), "", "in_progress",
                                        [] if self.want_logprobs else None)
            events.append(self.event("response.output_item.added",
                                     output_index=self._add_item(self.message),
                                     item={**self.message, "content": []}))
            events.append(self.event("response.content_part.added", **self._where(),
                                     content_index=0, part=self.message["content"][0]))
        part = self.message["content"][0]
        self._grow(part, "text", text)
        if self.want_logprobs:
            part["logprobs"].extend(logprobs)
        events.append(self.event("response.output_text.delta", **self._where(),
                                 content_index=0, delta=text, logprobs=logprobs))
        return events

    def _where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        item = item or self.message
        assert item is not None
        return {"item_id": item["id"], "output_index": self._index[id(item)]}

    def _reasoning(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self.reasoning is None:
            self.reasoning = reasoning_item(new_id("rs"), "", "in_progress")
            events.append(self.event("response.output_item.added",
                                     output_index=self._add_item(self.reasoning),
                                     item={**self.reasoning, "content": []}))
            events.append(self.event("response.content_part.added",
                                     **self._where(self.reasoning), content_index=0,
                                     part=self.reasoning["content"][0]))
        self._grow(self.reasoning["content"][0], "text", text)
        events.append(self.event("response.reasoning_text.delta", **self._where(self.reasoning),
                                 content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[bytes]:
        if self.reasoning is None:
            return []
        where, part = self._where(self.reasoning), self.reasoning["content"][0]
        self._settle(part, "text")
        self.reasoning["status"] = status
        events = [
            self.event("response.reasoning_text.done", **where, content_index=0,
                       text=part["text"]),
            self.event("response.content_part.done", **where, content_index=0, part=part),
            self.event("response.output_item.done", output_index=where["output_index"],
                       item=self.reasoning),
        ]
        self.reasoning = None
        return events

    @property
    def reasoning_text(self) -> str:
        """Everything the model thought (every reasoning item's text)."""
        self._settle()
        return "".join(item["content"][0]["text"] for item in self.items
                       if item["type"] == "reasoning")

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        events: list[bytes] = []
        item = self.calls.get(index)
        if item is None:
            events += self._close_reasoning("completed") + self._close_message("completed") \
                + self._close_calls()
            item = call_item(new_id("fc"), {"id": call.get("id") or new_id("call"),
                                            "function": {"name": function.get("name", "")}},
                             "in_progress")
            self.calls[index] = item
            events.append(self.event("response.output_item.added",
                                     output_index=self._add_item(item), item=dict(item)))
        fragment = function.get("arguments") or ""
        if fragment:
            self._grow(item, "arguments", fragment)
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=self._index[id(item)],
                                     delta=fragment))
        return events

    def _close_message(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        where, part = self._where(), self.message["content"][0]
        self._settle(part, "text")
        self.message["status"] = status
        events = [
            self.event("response.output_text.done", **where, content_index=0,
                       text=part["text"], logprobs=part.get("logprobs") or []),
            self.event("response.content_part.done", **where, content_index=0, part=part),
            self.event("response.output_item.done", output_index=where["output_index"],
                       item=self.message),
        ]
        self.message = None
        return events

    def _close_calls(self, status: str = "completed") -> list[bytes]:
        events = []
        for item in self.calls.values():
            item["status"] = status
            self._settle(item, "arguments")
            index = self._index[id(item)]
            events.append(self.event("response.function_call_arguments.done",
                                     item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=item))
        self.calls.clear()
        return events

    def finish(self, status: str, usage: dict[str, Any],
               incomplete: dict[str, Any] | None) -> list[bytes]:
        """Close the open items; the terminal event (``response.completed`` or
        ``response.incomplete``) carries the whole response."""
        self.closing = True
        item_status = "completed" if status == "completed" else "incomplete"
        events = self._close_reasoning(item_status) + self._close_message(item_status) \
            + self._close_calls(item_status)
        if not self.items:  # an empty answer is still one (empty) message, as unstreamed
            events += self._text_item_empty(item_status)
        self.response.update(status=status, output=self.items, usage=usage,
                             incomplete_details=incomplete)
        kind = "response.completed" if status == "completed" else f"response.{status}"
        return events + [self.event(kind, response=self.response)]

    def _text_item_empty(self, status: str) -> list[bytes]:
        self.message = message_item(new_id("msg"), "", "in_progress",
                                    [] if self.want_logprobs else None)
        events = [self.event("response.output_item.added",
                             output_index=self._add_item(self.message),
                             item={**self.message, "content": []}),
                  self.event("response.content_part.added", **self._where(), content_index=0,
                             part=self.message["content"][0])]
        return events + self._close_message(status)

    def fail(self, code: str, message: str, param: str | None) -> list[bytes]:
        """An ``error`` event, then ``response.failed`` with what was produced so far."""
        self.closing = True
        self._settle()
        self.response.update(status="failed", output=self.items,
                             error={"code": code, "message": message})
        return [self.event("error", code=code, message=message, param=param),
                self.event("response.failed", response=self.response)]
