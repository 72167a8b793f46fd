"""The PD router of ``radixlm serve-pd``: what sglang-router's PD mode does with a request.

With one prefill and one decode worker (no load balancing) it adds ``bootstrap_host``,
``bootstrap_port`` and a random ``bootstrap_room`` (lists of them for a batch or ``n > 1``,
as sglang-router), posts the same body to both servers at once, and answers with the
decode server's response (streamed when the request streams). A prefill error answers the
request at once and drops the decode request (its server then aborts the room). With
``return_logprob`` on /generate the prompt's logprobs, computed only by the prefill server,
are put in front of the decode server's (in every chunk of a stream). Other routes go to
the decode server; ``/health`` is 200 only when both are healthy.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

DUAL_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def batch_size(body: dict[str, Any]) -> int | None:
    """sglang-router's rule: ``n`` > 1, or a list prompt / text / batch of input_ids."""
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return n
    for key in ("prompt", "text"):
        if isinstance(body.get(key), list) and body[key] and (
                key == "text" or not isinstance(body[key][0], int)):
            return len(body[key])
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def inject_bootstrap(body: dict[str, Any], host: str, port: int) -> dict[str, Any]:
    size = batch_size(body)
    if size is None:
        return {**body, "bootstrap_host": host, "bootstrap_port": port,
                "bootstrap_room": secrets.randbits(63)}
    return {**body, "bootstrap_host": [host] * size, "bootstrap_port": [port] * size,
            "bootstrap_room": [secrets.randbits(63) for _ in range(size)]}


class PDRouter:
    def __init__(self, prefill_url: str, decode_url: str, bootstrap_host: str,
                 bootstrap_port: int) -> None:
        self.prefill, self.decode = prefill_url, decode_url
        self.host, self.port = bootstrap_host, bootstrap_port
        self.client = httpx.AsyncClient(timeout=None)

    def app(self) -> Starlette:
        routes = [Route(p, self.dual, methods=["POST"]) for p in DUAL_ROUTES]
        routes += [Route("/health", self.health, methods=["GET"]),
                   Route("/{path:path}", self.forward, methods=["GET", "POST"])]
        return Starlette(routes=routes)

    async def dual(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return Response('{"error": {"message": "the body is not JSON"}}', 400,
                            media_type="application/json")
        if not isinstance(body, dict):
            return await self.forward(request)
        body = inject_bootstrap(body, self.host, self.port)
        path = request.url.path
        pre = asyncio.create_task(self.client.post(self.prefill + path, json=body))
        if body.get("stream"):
            return StreamingResponse(self._stream(path, body, pre),
                                     media_type="text/event-stream")
        dec = asyncio.create_task(self.client.post(self.decode + path, json=body))
        await asyncio.wait({pre, dec}, return_when=asyncio.FIRST_COMPLETED)
        if pre.done() and (pre.exception() is not None or pre.result().status_code != 200):
            dec.cancel()  # the decode server sees the client leave and aborts the room
            return _error_response(pre, "prefill")
        resp = await dec
        await asyncio.gather(pre, return_exceptions=True)
        content = resp.content
        if body.get("return_logprob") and path == "/generate" and resp.status_code == 200:
            content = merge_prompt_logprobs(pre, content)
        return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))

    async def _stream(self, path: str, body: dict[str, Any], pre: asyncio.Task) -> Any:
        merge = bool(body.get("return_logprob")) and path == "/generate"
        try:
            async with self.client.stream("POST", self.decode + path, json=body) as resp:
                if not merge or resp.status_code != 200:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                    return
                prompt: dict[int, dict[str, list]] | None = None
                buf = b""
                async for chunk in resp.aiter_raw():
                    *events, buf = (buf + chunk).split(b"\n\n")
                    for event in events:
                        if prompt is None:  # the prefill's answer ends as the KV leaves
                            await asyncio.gather(pre, return_exceptions=True)
                            prompt = _prefill_prompt_logprobs(pre, streamed=True)
                        yield _merge_event(event, prompt) + b"\n\n"
                if buf:
                    yield buf
        finally:
            await asyncio.gather(pre, return_exceptions=True)

    async def health(self, request: Request) -> Response:
        for url in (self.prefill, self.decode):
            try:
                if (await self.client.get(url + "/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    async def forward(self, request: Request) -> Response:
        url = self.decode + request.url.path
        resp = await self.client.request(request.method, url, params=request.query_params,
                                         content=await request.body(),
                                         headers={"content-type": request.headers.get(
                                             "content-type", "application/json")})
        return Response(resp.content, resp.status_code,
                        media_type=resp.headers.get("content-type"))


# the prompt's logprobs are computed on the prefill server only
PROMPT_LOGPROB_FIELDS = ("input_token_logprobs", "input_top_logprobs",
                         "input_token_ids_logprobs")


def merge_prompt_logprobs(pre: asyncio.Task, decode_body: bytes) -> bytes:
    """A /generate answer with return_logprob: the decode server's, with the prefill
    server's prompt logprobs put in front of its own (sglang-router merges
    ``input_token_logprobs`` the same way), per result of a batch."""
    prompt = _prefill_prompt_logprobs(pre, streamed=False)
    try:
        decode = json.loads(decode_body)
    except ValueError:
        return decode_body
    for i, result in enumerate(decode if isinstance(decode, list) else [decode]):
        _prepend(result, prompt.get(i))
    return json.dumps(decode).encode()


def _prefill_prompt_logprobs(pre: asyncio.Task, streamed: bool) -> dict[int, dict[str, list]]:
    """The prefill server's prompt logprobs per result index, from its JSON answer or,
    for a stream, from the last event of each index ({} when it failed)."""
    if pre.exception() is not None or pre.result().status_code != 200:
        return {}
    content = pre.result().content
    try:
        if not streamed:
            parsed = json.loads(content)
            results = enumerate(parsed if isinstance(parsed, list) else [parsed])
        else:
            events = [json.loads(line[5:]) for line in content.split(b"\n")
                      if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
            results = ((e.get("index", 0), e) for e in events)
    except ValueError:
        return {}
    prompt: dict[int, dict[str, list]] = {}
    for i, result in results:
        meta = result.get("meta_info", {}) if isinstance(result, dict) else {}
        prompt[i] = {k: meta[k] for k in PROMPT_LOGPROB_FIELDS if isinstance(meta.get(k), list)}
    return prompt


def _prepend(result: Any, prompt: dict[str, list] | None) -> None:
    meta = result.get("meta_info") if isinstance(result, dict) else None
    if not prompt or not isinstance(meta, dict):
        return
    for key, values in prompt.items():
        if isinstance(meta.get(key), list):
            meta[key] = values + meta[key]


def _merge_event(event: bytes, prompt: dict[int, dict[str, list]]) -> bytes:
    """One SSE event of the decode server's stream (``data: {...}``; every chunk carries
    the whole meta_info), with the prompt's logprobs of its index put in front."""
    if not prompt or not event.startswith(b"data:") or event[5:].strip() == b"[DONE]":
        return event
    try:
        chunk = json.loads(event[5:])
    except ValueError:
        return event
    if isinstance(chunk, dict):
        _prepend(chunk, prompt.get(chunk.get("index", 0)))
    return b"data: " + json.dumps(chunk).encode()


def _error_response(task: asyncio.Task, who: str) -> Response:
    err = task.exception()
    if err is not None:
        return Response(f'{{"error": {{"message": "{who} server unreachable"}}}}', 502,
                        media_type="application/json")
    resp = task.result()
    return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
