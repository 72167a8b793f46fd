"""SGLang's native routes: /generate, health, info, cache, weights, tokenize, load, metrics.

Each route validates its body against a model of ``protocol.py`` (400 naming the field),
hands the request to the TokenizerManager and shapes the answer as SGLang 0.5 does, so
SGLang's ``RuntimeEndpoint`` and sglang-router work against it unchanged.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request, Response

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.auth import (
    request_tenant,
    require_admin,
    require_server_wide,
)
from radixlm.runtime.entrypoints.http_utils import (
    SSE_DONE,
    await_or_disconnect,
    json_response,
    large_json_response,
    pick,
    read_model,
    sse,
    sse_response,
)
from radixlm.runtime.entrypoints.loads import legacy_load, v1_loads_response
from radixlm.runtime.entrypoints.primed import PrimedOutputs, prime
from radixlm.runtime.entrypoints.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    UpdateWeightFromDiskRequest,
)
from radixlm.runtime.entrypoints.server_info import (
    full_server_info,
    tenant_model_info,
    tenant_server_info,
)
from radixlm.runtime.entrypoints.weights_root import resolve_under_root
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.messages import UpdateWeightFromDiskReq
from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import TokenizerManager


def radixlm_version() -> str:
    try:
        return importlib.metadata.version("radixlm")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


FLUSH_RETRY_S = 0.05
FLUSHED_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
HEALTH_TIMEOUT_S = 20.0


def _token_ids_logprob(body: GenerateRequest, i: int, batch: bool) -> list[int] | None:
    try:
        return body.token_ids_for(i, batch)
    except ValueError as e:
        raise ApiError(400, str(e), param="token_ids_logprob") from None


class NativeRoutes:
    def __init__(self, app: FastAPI, tm: TokenizerManager, args: ServerArgs,
                 pids: dict[str, int | None], heartbeat_age: Callable[[], float]) -> None:
        self.tm, self.args, self.pids, self.heartbeat_age = tm, args, pids, heartbeat_age
        for path, fn, methods in [
            ("/generate", self.generate, ["POST"]),
            ("/health", self.health, ["GET"]),
            ("/health_generate", self.health_generate, ["GET"]),
            ("/get_model_info", self.model_info, ["GET"]),
            ("/model_info", self.model_info, ["GET"]),  # SGLang 0.5's newer names
            ("/get_server_info", self.server_info, ["GET"]),
            ("/server_info", self.server_info, ["GET"]),
            ("/flush_cache", self.flush_cache, ["POST", "GET"]),
            ("/abort_request", self.abort_request, ["POST"]),
            ("/update_weights_from_disk", self.update_weights_from_disk, ["POST"]),
            ("/tokenize", self.tokenize, ["POST"]),
            ("/detokenize", self.detokenize, ["POST"]),
            ("/metrics", self.metrics, ["GET"]),
            ("/get_load", self.get_load, ["GET"]),  # what sglang-router polls
            ("/v1/loads", self.v1_loads, ["GET"]),  # SGLang 0.5's form
        ]:
            app.add_api_route(path, fn, methods=methods)

    async def _inputs(self, body: GenerateRequest) -> tuple[list[list[int]], bool]:
        text, ids = body.text, body.input_ids
        if (text is None) == (ids is None):
            raise ApiError(400, "give exactly one of text or input_ids", param="text")
        if text is not None:
            batch = isinstance(text, list)
            return await self.tm.encode_texts(text if batch else [text]), batch
        batch = bool(ids) and isinstance(ids[0], list)
        if batch:
            self.tm.text_bounds.check_count(len(ids), "input_ids")
        return (ids if batch else [ids]), batch  # type: ignore[return-value]

    async def generate(self, request: Request) -> Response:
        t0 = time.monotonic()
        body = await read_model(request, GenerateRequest)
        ids_list, batch = await self._inputs(body)
        if batch and not ids_list:
            raise ApiError(400, "the batch is empty", param="text")
        items = []
        for i, ids in enumerate(ids_list):
            sp = pick(body, "sampling_params", i, batch, None)
            items.append(self.tm.prepare(
                ids,
                None if sp is None else sp.to_dict(),
                pick(body, "rid", i, batch, None),
                pick(body, "return_logprob", i, batch, False),
                pick(body, "logprob_start_len", i, batch, -1),
                pick(body, "top_logprobs_num", i, batch, 0),
                body.return_text_in_logprobs,
                self.tm.namespace(pick(body, "extra_key", i, batch, None),
                                  pick(body, "cache_salt", i, batch, None),
                                  request_tenant(request)),
                _token_ids_logprob(body, i, batch), body.custom_labels, body.log_metrics,
                priority=body.priority, tenant=request_tenant(request),
            ))
            items[-1].msg.routing_key = body.routing_key
            text = body.text[i] if isinstance(body.text, list) else body.text
            items[-1].origin = self.tm.log_origin("/generate", text, request_tenant(request),
                                                  bool(body.stream))
        self.tm.attach_routing(items, body)
        states = await self.tm.submit(items)
        many = batch or len(states) > 1
        if body.stream:  # the status waits for every request's first output or error
            primed = await prime(request, self.tm, states)
            return sse_response(self._stream(primed, many, t0))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        latency = time.monotonic() - t0
        results = [b.to_dict(latency) for b in builders]
        if body.return_prompt_token_ids:  # SGLang's top-level key
            for r, s in zip(results, states):
                r["prompt_token_ids"] = list(s.msg.input_ids)
        return await large_json_response(results if many else results[0])

    async def _stream(self, primed: PrimedOutputs, many: bool,
                      t0: float) -> AsyncIterator[bytes]:
        states = primed.states
        builders = [self.tm.new_builder(s) for s in states]
        async for i, out in primed:
            builders[i].add(out)
            builders[i].weight_version = states[i].weight_version
            chunk = builders[i].chunk(time.monotonic() - t0, cumulative=True)
            if many:
                chunk["index"] = i
            yield sse(chunk)
        yield SSE_DONE

    async def health(self) -> Response:
        """200 while the scheduler's loop is alive (its heartbeat is recent) and the
        server is not shutting down; 503 otherwise."""
        problem = self.tm.unhealthy or ("shutting down" if self.tm.draining else None)
        if problem is None and self.heartbeat_age() > self.args.watchdog_timeout:
            problem = f"the scheduler made no progress for {self.heartbeat_age():.0f} s"
        if problem is not None:
            return json_response(ApiError(503, problem, "service_unavailable").body(), 503)
        return Response(status_code=200)

    async def health_generate(self) -> Response:
        embed = self.args.is_embedding  # an embedding server computes one prompt token
        item = self.tm.prepare(
            [0], {"max_new_tokens": 0 if embed else 1, "temperature": 0},
            f"health-{time.monotonic_ns()}", embedding=embed,
        )
        states = await self.tm.submit([item])
        try:
            await asyncio.wait_for(self.tm.collect(states[0]), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(
                503, f"no token generated within {HEALTH_TIMEOUT_S} s", "service_unavailable"
            ) from None
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        """SGLang's answer; a tenant gets the model's and tokenizer's names, not paths."""
        info = {
            "model_path": self.tm.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.tm.model_path,
            "is_generation": not self.args.is_embedding,
            "chat_template": getattr(self.tm.tokenizer, "chat_template", None),
            "bos_token": getattr(self.tm.tokenizer, "bos_token", None),
            "eos_token": getattr(self.tm.tokenizer, "eos_token", None),
            "weight_version": self.tm.weight_version,
        }
        if request_tenant(request) is not None:
            info = tenant_model_info(info, self.args, self.tm.model_path)
        return json_response(info)

    async def server_info(self, request: Request) -> Response:
        """SGLang's full form (``server_info.py``), or a tenant's own view of it."""
        tenant = request_tenant(request)
        if tenant is not None:
            return json_response(await tenant_server_info(self.tm, self.args, tenant))
        return json_response(await full_server_info(self.tm, self.args, self.pids))

    async def flush_cache(self, request: Request) -> Response:
        """SGLang's shape: plain text, 200 or 400; ``?timeout=S`` waits up to S seconds for
        the running and queued requests to finish first. The admin's (``auth.py``)."""
        require_admin(request, "/flush_cache")
        deadline = time.monotonic() + _flush_timeout(request.query_params.get("timeout"))
        while not (out := await self.tm.flush_cache()).success and time.monotonic() < deadline:
            await asyncio.sleep(FLUSH_RETRY_S)
        if out.success:
            return Response(FLUSHED_TEXT, 200, media_type="text/plain")
        return Response(out.message or "Flush cache failed.\n", 400, media_type="text/plain")

    async def abort_request(self, request: Request) -> Response:
        """SGLang's shape: an empty 200; a rid aborts every request whose rid starts with
        it (a tenant's only among its own), ``abort_all`` is the admin's. Neither rid nor
        abort_all is a 400 (SGLang ignores it)."""
        body = await read_model(request, AbortRequest)
        if body.abort_all:
            require_admin(request, "abort_all")
            self.tm.abort_all()
        elif body.rid:
            self.tm.abort_prefix(body.rid, request_tenant(request))
        else:
            raise ApiError(400, "give rid (a non-empty string) or abort_all: true", param="rid")
        return Response(status_code=200)

    async def update_weights_from_disk(self, request: Request) -> Response:
        """SGLang's route: ``{success, message, num_paused_requests}``, 200 or 400. The
        admin's; only from under ``--weights-root`` when it is set (``weights_root.py``)."""
        require_admin(request, "/update_weights_from_disk")
        body = await read_model(request, UpdateWeightFromDiskRequest)
        refused = body.refused()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        model_path = resolve_under_root(body.model_path, self.args.weights_root)
        out = await self.tm.update_weights_from_disk(UpdateWeightFromDiskReq(
            model_path, body.abort_all_requests, body.weight_version,
            body.torch_empty_cache))
        content = {"success": out.success, "message": out.message,
                   "num_paused_requests": out.num_paused_requests}
        return json_response(content, 200 if out.success else 400)

    async def tokenize(self, request: Request) -> Response:
        body = await read_model(request, TokenizeRequest)
        text = body.text if body.text is not None else body.prompt
        if text is None:
            raise ApiError(400, "text must be a string or a list of strings", param="text")
        many = isinstance(text, list)
        param = "text" if body.text is not None else "prompt"
        tokens = await self.tm.encode_texts(text if many else [text], body.add_special_tokens,
                                            param)
        return json_response(
            {
                "tokens": tokens if many else tokens[0],
                "count": [len(t) for t in tokens] if many else len(tokens[0]),
                "max_model_len": self.tm.server_info["context_length"],
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = await read_model(request, DetokenizeRequest)
        vocab = self.tm.model_info["vocab_size"]
        if body.tokens and max(body.tokens) >= vocab:
            raise ApiError(400, f"tokens must be in [0, {vocab})", param="tokens")
        return json_response({"text": await self.tm.tokenize_pool.decode(body.tokens)})

    async def get_load(self, request: Request) -> Response:
        """One entry per live data-parallel replica (SGLang's shape); not for tenants."""
        require_server_wide(request, "/get_load")
        return json_response([legacy_load(info) for info in await self.tm.replica_infos()])

    async def v1_loads(self, request: Request) -> Response:
        require_server_wide(request, "/v1/loads")
        device = self.tm.model_info.get("device")
        return v1_loads_response(await self.tm.replica_infos(), request.query_params,
                                 self.args.dp_size, radixlm_version(),
                                 None if device == "cpu" else device, self.args.tp_size)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text; with keys set, the admin's (it names every tenant)."""
        require_admin(request, "/metrics")
        data = self.tm.metrics.render(await self.tm.get_info())
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")


def _flush_timeout(raw: str | None) -> float:
    """``/flush_cache?timeout=`` (SGLang's query parameter): seconds >= 0."""
    try:
        value = 0.0 if raw is None else float(raw)
    except ValueError:
        value = -1.0
    if not (0.0 <= value < float("inf")):
        raise ApiError(400, f"timeout must be a finite number >= 0, got {raw!r}",
                       param="timeout")
    return value
