"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A response is a translation to the chat-completions machinery (``openai_api.py``): its
``instructions``, stored history (``previous_response_id``) and input items become a chat
conversation (``responses_items.py``), its options a ``ChatCompletionRequest`` (function
tools, ``text.format`` as ``response_format``, ``max_output_tokens``, logprobs), and the
chat job's choice or chunk deltas become output items or stream events
(``responses_stream.py``); with ``--reasoning-parser`` the thinking is a ``reasoning`` item
and ``usage.output_tokens_details.reasoning_tokens`` counts it. Finished responses are kept
in a bounded, tenant-scoped store (``responses_store.py``) unless ``store`` is false; they
are encoded (and read back) on the JSON thread (``http_utils.off_loop``), never on the
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from radixlm.runtime.entrypoints.auth import request_tenant
from radixlm.runtime.entrypoints.http_utils import (
    await_or_disconnect,
    encode_json,
    finish_reason_str,
    json_response,
    off_loop,
    read_model,
    sse_response,
)
from radixlm.runtime.entrypoints.openai.openai_api import OpenAIRoutes
from radixlm.runtime.entrypoints.openai.openai_jobs import ChatJob
from radixlm.runtime.entrypoints.openai.responses_items import (
    chat_tool_choice,
    chat_tools,
    history_messages,
    input_messages,
    new_id,
    output_items,
)
from radixlm.runtime.entrypoints.openai.responses_protocol import ResponsesRequest, TextFormat
from radixlm.runtime.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from radixlm.runtime.entrypoints.openai.responses_stream import ResponseEvents
from radixlm.runtime.entrypoints.primed import PrimedOutputs, prime
from radixlm.runtime.entrypoints.protocol import ChatCompletionRequest
from radixlm.runtime.entrypoints.validation_errors import describe
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.messages import TextOutput

logger = logging.getLogger(__name__)

# ResponsesRequest field -> ChatCompletionRequest field, passed through when set
_CHAT_FIELDS = {
    "model": "model", "max_output_tokens": "max_completion_tokens",
    "temperature": "temperature", "top_p": "top_p", "parallel_tool_calls":
    "parallel_tool_calls", "stream": "stream", "user": "user", "seed": "seed", "top_k": "top_k",
    "min_p": "min_p", "repetition_penalty": "repetition_penalty", "presence_penalty":
    "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "min_tokens":
    "min_tokens", "priority": "priority", "cache_salt": "cache_salt", "extra_key": "extra_key",
    "chat_template_kwargs": "chat_template_kwargs",
}


class ResponsesRoutes:
    def __init__(self, chat: OpenAIRoutes, store: ResponseStore) -> None:
        self.chat, self.store = chat, store
        self.router = APIRouter()
        add = self.router.add_api_route
        add("/v1/responses", self.create, methods=["POST"])
        add("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        add("/v1/responses/{response_id}", self.delete, methods=["DELETE"])
        add("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"])
        add("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])

    # --- stored responses ------------------------------------------------------------------
    def _stored(self, request: Request, response_id: str, param: str | None = None
                ) -> StoredResponse:
        entry = self.store.get(response_id, request_tenant(request))
        if entry is None:  # another tenant's id reads as unknown
            raise ApiError(404, f"Response with id '{response_id}' not found.",
                           "invalid_request_error", param=param, code="response_not_found")
        return entry

    async def retrieve(self, request: Request, response_id: str) -> Response:
        if request.query_params.get("stream", "false").lower() != "false":
            raise ApiError(400, "stream is not supported: a stored response cannot be "
                           "replayed as events; GET it without stream", param="stream")
        return _json_bytes(self._stored(request, response_id).response)

    async def delete(self, request: Request, response_id: str) -> Response:
        if not self.store.delete(response_id, request_tenant(request)):
            self._stored(request, response_id)  # the 404
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request, response_id: str) -> Response:
        entry = self._stored(request, response_id)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', got {order[:64]!r}",
                           param="order")
        return _json_bytes(await off_loop(items_page, entry, order == "desc"))

    async def cancel(self, request: Request, response_id: str) -> Response:
        self._stored(request, response_id)
        raise ApiError(400, "Only background responses can be cancelled; radixlm has no "
                       "background responses (close the stream to stop one)",
                       param="response_id")

    # --- POST /v1/responses ----------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body = await read_model(request, ResponsesRequest)
        body.log_unknown_fields()
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            chain = self._stored(request, body.previous_response_id, "previous_response_id")
            history = await off_loop(_decoded, chain.messages)
        if not body.input and not history:
            raise ApiError(400, "input must not be empty (without previous_response_id)",
                           param="input")
        items: list[dict[str, Any]] = []  # validating megabytes of items takes a while
        new = await asyncio.to_thread(input_messages, body.input, items)
        system = [{"role": "system", "content": body.instructions}] if body.instructions \
            else []
        # the whole conversation (history decoded from the store included) is validated as
        # a chat request: megabytes of it, so off the loop like the items
        chat_request = await asyncio.to_thread(self._chat_request, body, system + history + new)
        job, states = await self.chat.start_chat(request, chat_request, "/v1/responses")
        response = self._skeleton(body)
        turn = Turn(self, request, body, response, history + new, items)
        if body.stream:
            return sse_response(turn.stream(job, await prime(request, self.chat.tm, states)))
        builder = await await_or_disconnect(request, self.chat.tm.collect(states[0]))
        chat = job.response([builder])
        status, incomplete, error = _outcome(builder.last)
        choice = chat["choices"][0]
        response.update(status=status, incomplete_details=incomplete, error=error,
                        output=output_items(choice, _item_status(status), body.want_logprobs),
                        usage=responses_usage(chat["usage"], await self.reasoning_tokens(
                            choice["message"].get("reasoning_content"))))
        return _json_bytes(await turn.keep())

    async def reasoning_tokens(self, reasoning: str | None) -> int:
        """The tokens of the thinking: its text tokenized again (the split is made on the
        text, by ``--reasoning-parser``); a tokenizer releases the GIL, so off the loop."""
        if not reasoning:
            return 0
        tokenizer = self.chat.tm.tokenizer
        ids = await asyncio.to_thread(tokenizer.encode, reasoning, add_special_tokens=False)
        return len(ids)

    def _chat_request(self, body: ResponsesRequest, messages: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        data: dict[str, Any] = {"messages": messages}
        for name, chat_name in _CHAT_FIELDS.items():
            if getattr(body, name) is not None:
                data[chat_name] = getattr(body, name)
        if body.want_logprobs:
            data["logprobs"] = True
            data["top_logprobs"] = body.top_logprobs or 0
        fmt = body.text.format if body.text is not None else None
        if fmt is not None and fmt.type != "text":
            data["response_format"] = _response_format(fmt)
        tools = chat_tools(body.tools)
        if tools:
            data["tools"] = tools
        if body.tool_choice is not None:
            data["tool_choice"] = chat_tool_choice(body.tool_choice)
        try:
            return ChatCompletionRequest.model_validate(data, strict=True)
        except ValidationError as e:  # the items were checked: a message's shape is left
            message, param = describe(e)
            raise ApiError(400, message, param=param) from None

    def _skeleton(self, body: ResponsesRequest) -> dict[str, Any]:
        """The response object before its output (``Response`` of the openai package)."""
        fmt = body.text.format if body.text is not None and body.text.format else None
        return {
            "id": new_id("resp"), "object": "response", "created_at": time.time(),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.chat.served_model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False, "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": body.top_p, "top_logprobs": body.top_logprobs, "truncation": "disabled",
            "usage": None, "user": body.user, "metadata": body.metadata or {},
            "background": False, "service_tier": "default",
            "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
        }


class Turn:
    """One response being produced: streams it, then stores it unless ``store`` is false."""

    def __init__(self, routes: ResponsesRoutes, request: Request, body: ResponsesRequest,
                 response: dict[str, Any], conversation: list[dict[str, Any]],
                 items: list[dict[str, Any]]) -> None:
        """``conversation``: the chat messages rendered (history and input); ``items``:
        this turn's input items as read (``input_messages``' ``kept``)."""
        self.routes, self.request, self.body = routes, request, body
        self.response, self.conversation, self.items = response, conversation, items

    async def keep(self) -> bytes:
        """Store the finished response with its conversation (this turn's output added)
        unless ``store`` is false; the response's JSON. Encoded on the JSON thread."""
        self.response["completed_at"] = time.time() \
            if self.response["status"] == "completed" else None
        if self.body.store is False:
            return await off_loop(encode_json, self.response)
        messages = self.conversation + history_messages(self.response["output"])
        entry = await off_loop(StoredResponse.of, self.response, messages, self.items)
        self.routes.store.put(self.response["id"], entry, request_tenant(self.request))
        return entry.response

    async def stream(self, job: ChatJob, primed: PrimedOutputs) -> AsyncIterator[bytes]:
        events = ResponseEvents(self.response, self.body.want_logprobs)
        for chunk in events.begin():
            yield chunk
        last: TextOutput | None = None
        try:
            async for i, out in primed:
                last = out
                choice = job.stream_choice(i, out)
                if choice is not None:
                    lps = (choice.get("logprobs") or {}).get("content")
                    for chunk in events.delta(choice["delta"], lps):
                        yield chunk
        except ApiError as e:
            for chunk in await off_loop(events.fail, e.code, e.message, e.param):
                yield chunk
            return
        assert last is not None
        status, incomplete, error = _outcome(last)
        if error is not None:
            for chunk in await off_loop(events.fail, error["code"], error["message"], None):
                yield chunk
            return
        usage = responses_usage(job.usage([last]),
                                await self.routes.reasoning_tokens(events.reasoning_text))
        for chunk in await off_loop(events.finish, status, usage, incomplete):
            yield chunk
        await self.keep()


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``."""
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ApiError(400, "text.format.schema must be an object (a JSON schema)",
                       param="text.format.schema")
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def _outcome(last: TextOutput) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """``(status, incomplete_details, error)`` of a finished request."""
    reason = finish_reason_str(last.finish_reason)
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason == "abort":
        message = (last.finish_reason or {}).get("message") or "the request was aborted"
        return "failed", None, {"code": "server_error", "message": message}
    return "completed", None, None


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


def responses_usage(chat: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """Chat usage in the Responses shape. radixlm's prefix cache is implicit: it has no
    explicit cache writes (``cache_write_tokens`` 0)."""
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"][
            "cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, chat["completion_tokens"])},
        "total_tokens": chat["total_tokens"],
    }


def _json_bytes(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def _decoded(messages: tuple[bytes, ...]) -> list[dict[str, Any]]:
    """A stored conversation's messages, decoded one by one (the JSON thread gets the GIL
    back between them)."""
    return [msgspec.json.decode(m) for m in messages]


def items_page(entry: StoredResponse, desc: bool) -> bytes:
    """``GET .../input_items``' list object, joined from the stored items' JSON."""
    items, ids = entry.input_items, entry.item_ids
    if desc:
        items, ids = items[::-1], ids[::-1]
    return b"".join([b'{"object":"list","data":[', b",".join(items),
                     b'],"has_more":false,"first_id":',
                     msgspec.json.encode(ids[0] if ids else None), b',"last_id":',
                     msgspec.json.encode(ids[-1] if ids else None), b"}"])
