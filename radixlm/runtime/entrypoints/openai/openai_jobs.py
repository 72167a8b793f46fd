"""Response shaping of the OpenAI routes: one ``Job`` per HTTP request turns the
requests' outputs into OpenAI's completion / chat-completion objects and stream chunks."""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixlm.runtime.entrypoints.http_utils import SSE_DONE, finish_reason_str, sse
from radixlm.runtime.entrypoints.openai.chat_output import ChoiceOutput
from radixlm.runtime.entrypoints.primed import PrimedOutputs
from radixlm.runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from radixlm.runtime.managers.messages import TextOutput
from radixlm.runtime.managers.tokenizer_manager.admission import Prepared


class Job(abc.ABC):
    """One OpenAI request: its ``n`` choices per prompt and their usage."""

    object_name = ""
    id_prefix = ""

    def __init__(self, routes: Any, items: list[Prepared], body: Any) -> None:
        self.routes = routes
        self.items = items
        self.n = items[0].params.n
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.model = routes.response_model(body.model)
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage

    def envelope(self, choices: list[dict[str, Any]], object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
        }

    def usage(self, outs: list[TextOutput | None]) -> dict[str, Any]:
        """Each prompt counted once, however many choices it has (OpenAI's and vLLM's
        ``prompt_tokens``), and so its cached tokens: never more than its tokens."""
        done = [o for o in outs if o is not None]
        prompt = cached = 0
        for i in range(0, len(outs), self.n):
            item = self.items[i // self.n]
            tokens = len(item.msg.input_ids)
            hit = item.prompt_cached_tokens
            if hit is None:  # no warm-up: the samples computed it alike
                hit = min((o.cached_tokens for o in outs[i:i + self.n] if o is not None),
                          default=0)
            prompt, cached = prompt + tokens, cached + min(hit, tokens)
        return self.routes.usage(prompt, sum(o.completion_tokens for o in done), cached)

    async def stream(self, primed: PrimedOutputs) -> AsyncIterator[bytes]:
        """The stream's chunks; ``primed`` holds every request's first output already."""
        last: list[TextOutput | None] = [None] * len(primed.gens)
        async for i, out in primed:
            last[i] = out
            chunk = self.stream_choice(i, out)
            if chunk is not None:
                yield sse(self.envelope([chunk], self.chunk_object))
        if self.include_usage:
            yield sse({**self.envelope([], self.chunk_object), "usage": self.usage(last)})
        yield SSE_DONE

    chunk_object = ""

    @abc.abstractmethod
    def stream_choice(self, i: int, out: TextOutput) -> dict[str, Any] | None:
        """The stream chunk's choice for output ``out`` of choice ``i`` (None: nothing)."""


class CompletionJob(Job):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def __init__(
        self, routes: Any, items: list[Prepared], echo: bool, body: CompletionRequest
    ) -> None:
        super().__init__(routes, items, body)
        self.echo = echo
        self.want_logprobs = body.logprobs is not None
        self.started: set[int] = set()

    def prompt_text(self, i: int) -> str:
        return self.routes.tm.tokenizer.decode(self.items[i // self.n].msg.input_ids)

    def logprobs(self, entries: list, tops: list, offset: int) -> dict[str, Any]:
        tokens = [e[2] or "" for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e[0] for e in entries],
            "top_logprobs": [
                None if t is None else {e[2] or "": e[0] for e in t}
                for t in (tops or [None] * len(entries))
            ],
            "text_offset": offsets,
        }

    def response(self, builders: list[Any]) -> dict[str, Any]:
        choices = []
        for i, b in enumerate(builders):
            text = (self.prompt_text(i) if self.echo else "") + b.text
            lp = None
            if self.want_logprobs:
                entries = (b.input_lps or []) + b.output_lps if self.echo else b.output_lps
                tops = ((b.input_top or []) + b.output_top) if self.echo else b.output_top
                lp = self.logprobs(entries, tops, 0)
            reason = b.last.finish_reason
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": finish_reason_str(reason),
                    "matched_stop": (reason or {}).get("matched"),
                }
            )
        return {
            **self.envelope(choices, "text_completion"),
            "usage": self.usage([b.last for b in builders]),
        }

    def stream_choice(self, i: int, out: TextOutput) -> dict[str, Any] | None:
        text = out.text
        if self.echo and i not in self.started:
            text = self.prompt_text(i) + text
        self.started.add(i)
        lp = None
        if self.want_logprobs and out.output_token_logprobs:
            lp = self.logprobs(out.output_token_logprobs, out.output_top_logprobs or [], 0)
        if not text and lp is None and not out.finished:
            return None
        return {
            "index": i,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish_reason_str(out.finish_reason),
        }


class ChatJob(Job):
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def __init__(self, routes: Any, item: Prepared, body: ChatCompletionRequest,
                 outputs: Callable[[], ChoiceOutput] | None = None) -> None:
        """``outputs``: a factory of each choice's reasoning / tool-call reader (None:
        the text is the content)."""
        super().__init__(routes, [item], body)
        self.want_logprobs = body.logprobs
        self.started: set[int] = set()
        self.outputs = outputs
        self.readers: dict[int, ChoiceOutput] = {}

    def reader(self, i: int) -> ChoiceOutput | None:
        if self.outputs is None:
            return None
        if i not in self.readers:
            self.readers[i] = self.outputs()
        return self.readers[i]

    @staticmethod
    def _token(entry: Any) -> dict[str, Any]:
        text = entry[2] or ""
        return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}

    def logprobs(self, entries: list, tops: list) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tops = tops or [None] * len(entries)
        return {
            "content": [
                {**self._token(e), "top_logprobs": [self._token(t) for t in top or []]}
                for e, top in zip(entries, tops)
            ]
        }

    def finish_reason(self, i: int, reason: dict[str, Any] | None) -> str | None:
        """OpenAI's ``tool_calls`` when the choice called tools (as vLLM and SGLang)."""
        reader = self.reader(i)
        if reason is not None and reader is not None and reader.called:
            return "tool_calls"
        return finish_reason_str(reason)

    def message(self, i: int, text: str) -> dict[str, Any]:
        reader = self.reader(i)
        fields = {"content": text} if reader is None else reader.message(text)
        return {"role": "assistant", **fields}

    def response(self, builders: list[Any]) -> dict[str, Any]:
        choices = []
        for i, b in enumerate(builders):
            message = self.message(i, b.text)
            choices.append({
                "index": i,
                "message": message,
                "logprobs": self.logprobs(b.output_lps, b.output_top),
                "finish_reason": self.finish_reason(i, b.last.finish_reason),
                "matched_stop": (b.last.finish_reason or {}).get("matched"),
            })
        return {
            **self.envelope(choices, "chat.completion"),
            "usage": self.usage([b.last for b in builders]),
        }

    def _delta_fields(self, i: int, out: TextOutput) -> dict[str, Any]:
        reader = self.reader(i)
        if reader is None:
            return {"content": out.text} if out.text else {}
        return reader.delta(out.text, final=out.finished)

    def stream_choice(self, i: int, out: TextOutput) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if i not in self.started:
            self.started.add(i)
            delta["role"] = "assistant"
            if self.outputs is None:
                delta["content"] = ""
        delta.update(self._delta_fields(i, out))
        lp = None
        if self.want_logprobs and out.output_token_logprobs:
            lp = self.logprobs(out.output_token_logprobs, out.output_top_logprobs or [])
        if not delta and lp is None and not out.finished:
            return None
        return {
            "index": i,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": self.finish_reason(i, out.finish_reason),
        }
