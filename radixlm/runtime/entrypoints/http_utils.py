"""HTTP helpers shared by the native routes (native_api.py) and OpenAI's (openai_api.py):
JSON bodies, responses, server-sent events, client-disconnect handling, the body limit
and the error handlers (every error in OpenAI's shape). API keys and tenants: ``auth.py``.

Large JSON stays off the event loop both ways: a large body is parsed on a worker thread
(``read_model``), and a response that can be large (a stored response, its input items,
``n`` choices with logprobs, a ``/generate`` batch) is encoded on the JSON thread
(``large_json_response``) in pieces, so the thread gives the GIL back between them: one
``msgspec`` call on 10 MB holds it for its whole ~20 ms, which would stall the loop even
from another thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
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
T = TypeVar("T")

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
PARSE_ON_LOOP_BYTES = 64 << 10  # bodies over this are parsed off the event loop


async def read_model(request: Request, model: type[M]) -> M:
    """The body parsed into ``model`` (``protocol.py``); 400 naming the field otherwise.
    The body's size was bounded by ``BodyLimitMiddleware`` before it was read; a large
    one is parsed on a worker thread (an 8 MB chat takes seconds to validate)."""
    body = await request.body()
    try:
        if len(body) <= PARSE_ON_LOOP_BYTES:
            return model.model_validate_json(body or b"{}")
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as e:
        message, param = describe(e)
        raise ApiError(400, message, param=param) from None


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


# --- large JSON, off the event loop ----------------------------------------------------------
# one thread: large bodies wait for each other, not the loop; with one thread beside it,
# the loop gets the GIL back at least every piece
_JSON_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixlm-json")
_PIECE_ITEMS = 256  # list elements encoded in one msgspec call
_PIECE_DEPTH = 6  # containers deeper than this are encoded in one call


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the JSON thread (encoding or joining large JSON)."""
    return await asyncio.get_running_loop().run_in_executor(_JSON_THREAD, fn, *args)


def encode_json(obj: Any) -> bytes:
    """``msgspec.json.encode(obj)``, the same bytes, made of many small encodes: dicts and
    lists are walked to ``_PIECE_DEPTH`` levels, long lists in slices of ``_PIECE_ITEMS``."""
    out: list[bytes] = []
    _pieces(obj, out, 0)
    return b"".join(out)


def _encode_piece(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def _pieces(obj: Any, out: list[bytes], depth: int) -> None:
    if depth >= _PIECE_DEPTH or not isinstance(obj, (dict, list)) or not obj:
        out.append(_encode_piece(obj))
    elif isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):  # msgspec's own key rules
            out.append(_encode_piece(obj))
            return
        sep = b"{"
        for key, value in obj.items():
            out.append(sep + _encode_piece(key) + b":")
            _pieces(value, out, depth + 1)
            sep = b","
        out.append(b"}")
    elif len(obj) > _PIECE_ITEMS:
        for i in range(0, len(obj), _PIECE_ITEMS):
            out.append((b"," if i else b"[") + _encode_piece(obj[i:i + _PIECE_ITEMS])[1:-1])
        out.append(b"]")
    else:
        for i, value in enumerate(obj):
            out.append(b"," if i else b"[")
            _pieces(value, out, depth + 1)
        out.append(b"]")


async def large_json_response(obj: Any, status: int = 200) -> Response:
    """``json_response`` for a body that can be large: encoded on the JSON thread."""
    return Response(await off_loop(encode_json, obj), status, media_type="application/json")


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


# --- middleware and errors ---------------------------------------------------------------
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
