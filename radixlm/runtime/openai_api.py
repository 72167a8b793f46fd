"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
and the HTTP helpers the native routes in ``server.py`` share (JSON bodies, SSE,
client-disconnect handling).

Extra sampling fields are accepted as SGLang and vLLM accept them (top_k, min_p,
ignore_eos, stop_token_ids, repetition_penalty, min_tokens, regex, json_schema, ...).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from radixlm.runtime.messages import TextOutput
from radixlm.runtime.tokenizer_manager import ApiError, Prepared, TokenizerManager

DISCONNECT_POLL_S = 0.25
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI / vLLM request field -> SamplingParams field
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "min_tokens": "min_new_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "regex": "regex",
    "json_schema": "json_schema",
    "logit_bias": "logit_bias",
}


# --- HTTP helpers ------------------------------------------------------------------------------
async def read_json(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        obj = json.loads(body) if body else {}
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return obj


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        _errors_as_events(chunks), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _errors_as_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Once the stream has begun, a bad request (e.g. a grammar that does not compile)
    arrives as an OpenAI-shaped error event, then ``[DONE]``."""
    try:
        async for chunk in chunks:
            yield chunk
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"


async def await_or_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client goes away first, cancel it (which aborts its
    requests in the scheduler) and answer 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


def finish_reason_str(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason.get("type")


def pick(body: dict[str, Any], key: str, i: int, batch: bool, default: Any) -> Any:
    """``body[key]`` for item ``i`` of a batch: a list holds one value per item."""
    value = body.get(key, default)
    if batch and isinstance(value, list):
        if i >= len(value):
            raise ApiError(400, f"{key} has {len(value)} entries, fewer than the batch", param=key)
        return value[i]
    return value


# --- shared by both OpenAI routes ------------------------------------------------------------
class OpenAIRoutes:
    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm = tm
        self.served_model_name = served_model_name
        self.created = int(time.time())
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        known = {self.served_model_name, self.tm.model_path, "default"}
        if model is not None and model not in known:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Served: `{self.served_model_name}`",
                param="model",
                code="model_not_found",
            )

    def sampling_params(self, body: dict[str, Any], max_tokens: Any) -> dict[str, Any]:
        sp = {"max_new_tokens": max_tokens}
        for key, name in _SAMPLING_FIELDS.items():
            if body.get(key) is not None:
                sp[name] = body[key]
        return sp

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def models(self) -> Response:
        ctx = self.tm.server_info["context_length"]
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "radixlm",
                        "root": self.tm.model_path,
                        "max_model_len": ctx,
                    }
                ],
            }
        )

    # --- /v1/completions ------------------------------------------------------------------------
    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tm.encode_text(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self.tm.encode_text(p, "prompt") for p in prompt]
            if all(isinstance(p, int) for p in prompt):
                return [list(prompt)]
            if all(isinstance(p, list) for p in prompt):
                return [list(p) for p in prompt]
        raise ApiError(
            400,
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists",
            param="prompt",
        )

    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body)
        prompts = self._prompts(body.get("prompt"))
        max_tokens = body.get("max_tokens")
        sp = self.sampling_params(
            body, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        )
        logprobs, echo = body.get("logprobs"), bool(body.get("echo"))
        items = [
            self.tm.prepare(
                ids,
                sp,
                return_logprob=logprobs is not None,
                logprob_start_len=0 if echo and logprobs is not None else -1,
                top_logprobs_num=logprobs or 0,
                text_in_logprobs=True,
            )
            for ids in prompts
        ]
        job = _CompletionJob(self, items, echo, body)
        states = await self.tm.submit(items)
        if body.get("stream"):
            return sse_response(job.stream(states))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        return json_response(job.response(builders))

    # --- /v1/chat/completions -------------------------------------------------------------------
    def _chat_prompt(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        conv = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a role and content", param="messages")
            content = m.get("content") or ""
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                )
            if not isinstance(content, str):
                raise ApiError(
                    400, "message content must be a string or a list of parts", param="messages"
                )
            conv.append({"role": m["role"], "content": content})
        try:
            text = self.tm.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise ApiError(
                400, f"the chat template failed on these messages: {e}", param="messages"
            ) from None
        return self.tm.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _response_format(body: dict[str, Any], sp: dict[str, Any]) -> None:
        fmt = body.get("response_format")
        if fmt is None:
            return
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            sp["json_schema"] = json.dumps({"type": "object"})
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(
                    400,
                    "response_format.json_schema.schema must be an object",
                    param="response_format",
                )
            sp["json_schema"] = json.dumps(schema)
        elif kind != "text":
            raise ApiError(
                400,
                f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                param="response_format",
            )

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body)
        ids = self._chat_prompt(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = max(self.tm.server_info["context_length"] - len(ids), 1)
        sp = self.sampling_params(body, max_tokens)
        self._response_format(body, sp)
        logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise ApiError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
        item = self.tm.prepare(
            ids, sp, return_logprob=logprobs, top_logprobs_num=top, text_in_logprobs=True
        )
        job = _ChatJob(self, item, body)
        states = await self.tm.submit([item])
        if body.get("stream"):
            return sse_response(job.stream(states))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        return json_response(job.response(builders))


class _Job:
    """One OpenAI request: its ``n`` choices per prompt and their usage."""

    object_name = ""
    id_prefix = ""

    def __init__(self, routes: OpenAIRoutes, items: list[Prepared], body: dict[str, Any]) -> None:
        self.routes = routes
        self.items = items
        self.n = items[0].params.n
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        opts = body.get("stream_options") or {}
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

    def envelope(self, choices: list[dict[str, Any]], object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": int(time.time()),
            "model": self.routes.served_model_name,
            "choices": choices,
        }

    def usage(self, outs: list[TextOutput | None]) -> dict[str, Any]:
        done = [o for o in outs if o is not None]
        prompt = sum(
            len(self.items[i // self.n].msg.input_ids) for i in range(0, len(outs), self.n)
        )
        cached = sum(o.cached_tokens for o in done)
        return OpenAIRoutes.usage(prompt, sum(o.completion_tokens for o in done), cached)

    async def stream(self, states: list[Any]) -> AsyncIterator[bytes]:
        last: list[TextOutput | None] = [None] * len(states)
        async for i, out in self.routes.tm.merged_outputs(states):
            last[i] = out
            chunk = self.stream_choice(i, out)
            if chunk is not None:
                yield sse(self.envelope([chunk], self.chunk_object))
        if self.include_usage:
            yield sse({**self.envelope([], self.chunk_object), "usage": self.usage(last)})
        yield SSE_DONE

    chunk_object = ""

    def stream_choice(self, i: int, out: TextOutput) -> dict[str, Any] | None:
        raise NotImplementedError


class _CompletionJob(_Job):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def __init__(
        self, routes: OpenAIRoutes, items: list[Prepared], echo: bool, body: dict[str, Any]
    ) -> None:
        super().__init__(routes, items, body)
        self.echo = echo
        self.want_logprobs = body.get("logprobs") is not None
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


class _ChatJob(_Job):
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def __init__(self, routes: OpenAIRoutes, item: Prepared, body: dict[str, Any]) -> None:
        super().__init__(routes, [item], body)
        self.want_logprobs = bool(body.get("logprobs"))
        self.started: set[int] = set()

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

    def response(self, builders: list[Any]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": b.text},
                "logprobs": self.logprobs(b.output_lps, b.output_top),
                "finish_reason": finish_reason_str(b.last.finish_reason),
                "matched_stop": (b.last.finish_reason or {}).get("matched"),
            }
            for i, b in enumerate(builders)
        ]
        return {
            **self.envelope(choices, "chat.completion"),
            "usage": self.usage([b.last for b in builders]),
        }

    def stream_choice(self, i: int, out: TextOutput) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if i not in self.started:
            self.started.add(i)
            delta["role"] = "assistant"
        if out.text or "role" in delta:
            delta["content"] = out.text
        lp = None
        if self.want_logprobs and out.output_token_logprobs:
            lp = self.logprobs(out.output_token_logprobs, out.output_top_logprobs or [])
        if not delta and lp is None and not out.finished:
            return None
        return {
            "index": i,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason_str(out.finish_reason),
        }
