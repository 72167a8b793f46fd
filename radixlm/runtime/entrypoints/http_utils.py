"""HTTP helpers shared by the native routes (native_api.py) and OpenAI's (openai_api.py):
JSON bodies, responses, server-sent events, client-disconnect handling, the API-key
middleware (one key, or a file of tenants' keys) and the error handlers (every error in
OpenAI's shape)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.runtime.entrypoints.validation_errors import describe
from radixlm.runtime.managers.api_error import ApiError

M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key


async def read_model(request: Request, model: type[M]) -> M:
    """The body parsed into ``model`` (``protocol.py``); 400 naming the field otherwise.
    The body's size was bounded by ``BodyLimitMiddleware`` before it was read."""
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        message, param = describe(e)
        raise ApiError(400, message, param=param) from None


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
                logger.debug("client disconnected from %s", request.url.path)
                raise ApiError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
        task.add_done_callback(_consume)


def _consume(task: asyncio.Future) -> None:
    """Retrieve an abandoned task's outcome so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


def finish_reason_str(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason.get("type")


def pick(body: Any, key: str, i: int, batch: bool, default: Any) -> Any:
    """Field ``key`` of ``body`` for item ``i``: in a batch, a list holds one value per
    item and anything else is shared; outside a batch a list is an error."""
    value = getattr(body, key)
    if value is None:
        return default
    if isinstance(value, list):
        if not batch:
            raise ApiError(400, f"{key} is a list but the request is not a batch", param=key)
        if i >= len(value):
            raise ApiError(400, f"{key} has {len(value)} entries, fewer than the batch", param=key)
        return default if value[i] is None else value[i]
    return value


# --- API keys and tenants ----------------------------------------------------------------
TENANT_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def load_api_keys(api_key: str) -> dict[bytes, str | None]:
    """``--api-key``: one key (tenant ``None``), or the path of a file of ``key tenant``
    lines (``#`` comments and blank lines allowed) whose keys each name their tenant.
    Returns ``{sha256(key): tenant}``; ValueError names the line of a bad file."""
    if not os.path.isfile(api_key):
        return {_digest(api_key.encode()): None}
    keys: dict[bytes, str | None] = {}
    with open(api_key, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{api_key}:{lineno}"
            if len(fields) != 2:
                raise ValueError(f"{where}: want 'key tenant', got {len(fields)} fields")
            key, tenant = fields
            if not TENANT_NAME.fullmatch(tenant):
                raise ValueError(f"{where}: tenant names are 1-64 of [A-Za-z0-9_.-], "
                                 f"got {tenant!r}")
            digest = _digest(key.encode())
            if digest in keys:
                raise ValueError(f"{where}: this key is listed twice")
            keys[digest] = tenant
    if not keys:
        raise ValueError(f"{api_key}: no 'key tenant' lines")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def request_tenant(request: Request) -> str | None:
    """The tenant whose key authenticated ``request`` (None: no tenants)."""
    return request.scope.get("state", {}).get("tenant")


# --- middleware and errors ---------------------------------------------------------------
class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or ``X-API-Key``) is one of ``keys``
    (``load_api_keys``); the key's tenant goes to the request's state (``request_tenant``).
    Keys are compared as SHA-256 digests, so the lookup time says nothing about a key."""

    def __init__(self, app: ASGIApp, keys: dict[bytes, str | None]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            key = (token.strip() if scheme.lower() == b"bearer"  # RFC 9110: any case
                   else headers.get(b"x-api-key", b""))
            digest = _digest(key)
            if digest not in self.keys:
                err = ApiError(
                    401,
                    "invalid or missing API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
                await json_response(err.body(), 401)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = self.keys[digest]
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads each request's body before the app does, so that a body over ``max_bytes``
    gets 413 before it is in memory (a declared Content-Length over it at once, a
    chunked one as soon as it passes), and one sent slower than ``read_timeout`` seconds
    gets 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isascii() and declared.isdigit() \
                and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, 413, int(declared))
            return
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                await self._refuse(scope, receive, send, 408, size)
                return
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, 413, size)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int,
                      size: int) -> None:
        if status == 413:
            err = ApiError(413, f"the request body has {size}+ bytes, over the limit of "
                           f"{self.max_bytes} bytes (--max-request-bytes)",
                           param="body", code="request_too_large")
        else:
            err = ApiError(408, f"the request body was not received within "
                           f"{self.read_timeout} s (--request-read-timeout)",
                           code="request_timeout")
        response = json_response(err.body(), status)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


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
