"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A response is a translation to the chat-completions machinery (``openai_api.py``): its
``instructions``, stored history (``previous_response_id``) and input items become a chat
conversation (``responses_items.py``), its options a ``ChatCompletionRequest`` (function
tools, ``text.format`` as ``response_format``, ``max_output_tokens``, logprobs), and the
chat job's choice or chunk deltas become output items or stream events
(``responses_stream.py``). Finished responses are kept in a bounded, tenant-scoped store
(``responses_store.py``) unless ``store`` is false.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from radixlm.runtime.entrypoints.auth import request_tenant
from radixlm.runtime.entrypoints.http_utils import (
    await_or_disconnect,
    finish_reason_str,
    json_response,
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
from radixlm.runtime.entrypoints.openai.responses_store import ResponseStore
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
    def _stored(self, request: Request, response_id: str, param: str | None = None) -> Any:
        entry = self.store.get(response_id, request_tenant(request))
        if entry is None:  # another tenant's id reads as unknown
            raise ApiError(404, f"Response with id '{response_id}' not found.",
                           "invalid_request_error", param=param, code="response_not_found")
        return entry

    async def retrieve(self, request: Request, response_id: str) -> Response:
        if request.query_params.get("stream", "false").lower() != "false":
            raise ApiError(400, "stream is not supported: a stored response cannot be "
                           "replayed as events; GET it without stream", param="stream")
        return json_response(self._stored(request, response_id).response)

    async def delete(self, request: Request, response_id: str) -> Response:
        if not self.store.delete(response_id, request_tenant(request)):
            self._stored(request, response_id)  # the 404
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request, response_id: str) -> Response:
        items = self._stored(request, response_id).input_items
        if request.query_params.get("order", "desc") == "desc":
            items = items[::-1]
        return json_response({"object": "list", "data": items, "has_more": False,
                              "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None})

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
            history = self._stored(request, body.previous_response_id,
                                   "previous_response_id").messages
        if not body.input and not history:
            raise ApiError(400, "input must not be empty (without previous_response_id)",
                           param="input")
        new = input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions \
            else []
        job, states = await self.chat.start_chat(
            request, self._chat_request(body, system + history + new), "/v1/responses")
        response = self._skeleton(body)
        turn = Turn(self, request, body, response, history + new)
        if body.stream:
            return sse_response(turn.stream(job, await prime(request, self.chat.tm, states)))
        builder = await await_or_disconnect(request, self.chat.tm.collect(states[0]))
        chat = job.response([builder])
        status, incomplete, error = _outcome(builder.last)
        response.update(status=status, incomplete_details=incomplete, error=error,
                        output=output_items(chat["choices"][0], _item_status(status),
                                            body.want_logprobs),
                        usage=responses_usage(chat["usage"]))
        turn.keep()
        return json_response(response)

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
                 response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.routes, self.request, self.body = routes, request, body
        self.response, self.conversation = response, conversation

    def keep(self) -> None:
        """Store the finished response with its conversation (this turn's output added)."""
        self.response["completed_at"] = time.time() \
            if self.response["status"] == "completed" else None
        if self.body.store is False:
            return
        items = self.body.input if isinstance(self.body.input, list) else \
            [{"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": self.body.input}]}]
        items = [{"id": item.get("id") or new_id("msg"), **item} for item in items]
        messages = self.conversation + history_messages(self.response["output"])
        self.routes.store.put(self.response, messages, items, request_tenant(self.request))

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
            for chunk in events.fail(e.code, e.message, e.param):
                yield chunk
            return
        assert last is not None
        status, incomplete, error = _outcome(last)
        if error is not None:
            for chunk in events.fail(error["code"], error["message"], None):
                yield chunk
            return
        for chunk in events.finish(status, responses_usage(job.usage([last])), incomplete):
            yield chunk
        self.keep()


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


def responses_usage(chat: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses shape. radixlm's prefix cache is implicit: it has no
    explicit cache writes (``cache_write_tokens`` 0) and no reasoning tokens to count."""
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"][
            "cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }
