"""HTTP helpers shared by the native routes (server.py) and OpenAI's (openai_api.py):
JSON bodies, responses, server-sent events, client-disconnect handling, the API-key
middleware and the error handlers (every error in OpenAI's shape)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm.runtime.managers.tokenizer_manager import ApiError

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key


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


# --- middleware and errors ---------------------------------------------------------------
class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or ``X-API-Key``) matches."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            key = (
                auth[7:].strip() if auth.startswith(b"Bearer ") else headers.get(b"x-api-key", b"")
            )
            if not hmac.compare_digest(key, self.api_key):
                err = ApiError(
                    401,
                    "invalid or missing API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
                await json_response(err.body(), 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError), exc
        return json_response(exc.body(), exc.status)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException), exc
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), kind)
        return json_response(err.body(), exc.status_code)

    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return json_response(
            ApiError(500, f"internal error: {exc!r}", "internal_error").body(), 500
        )

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_error)
