"""The embedding routes of an ``--is-embedding`` server: OpenAI's ``/v1/embeddings`` and
SGLang's native ``/encode``.

Each input becomes one prefill-only request through the tokenizer manager, the
scheduler and its radix cache, like a prompt (``managers/embedding_outputs.py`` pools
it); a batch's inputs are submitted together, so the scheduler batches their prefills.
On a server that generates text both routes answer 400, and an embedding server answers
400 to the generation routes (``Admission.prepare``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request, Response

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.auth import request_tenant
from radixlm.runtime.entrypoints.http_utils import (
    await_or_disconnect,
    large_json_response,
    read_model,
)
from radixlm.runtime.entrypoints.openai.embedding_protocol import (
    EMBEDDING_ON_GENERATION,
    EmbeddingRequest,
    EncodeRequest,
    encode_result,
    openai_embeddings,
)
from radixlm.runtime.entrypoints.openai.openai_api import OpenAIRoutes, fields_named
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.messages import TextOutput
from radixlm.runtime.managers.tokenizer_manager.admission import Prepared
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import client_rid
from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import ReqState, TokenizerManager


class EmbeddingRoutes:
    def __init__(self, app: FastAPI, tm: TokenizerManager, args: ServerArgs,
                 models: OpenAIRoutes) -> None:
        """``models``: the OpenAI routes, whose model names these share (the check of a
        request's ``model``, a 404, and the ``model`` of an answer)."""
        self.tm, self.args, self.models = tm, args, models
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])
        app.add_api_route("/encode", self.encode, methods=["POST"])

    def _check_serving(self) -> None:
        if not self.args.is_embedding:
            raise ApiError(400, EMBEDDING_ON_GENERATION)

    # --- OpenAI ------------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        body = await read_model(request, EmbeddingRequest)
        tenant = request_tenant(request)
        self.models.check_model(body.model, tenant)
        self._check_serving()
        refused = body.unsupported(self.tm.server_info["pooling"]["normalize"])
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        texts, ids_list = await self._openai_inputs(body.input, body.add_special_tokens)
        namespace = self.tm.namespace(None, body.cache_salt, tenant)
        rids = _rids(body.rid, len(ids_list))
        with fields_named({"input_ids": "input"}):  # OpenAI's field holds the ids
            items = [self._prepare(ids, rid, namespace, body.priority, tenant, True)
                     for ids, rid in zip(ids_list, rids)]
        self._log_origins(items, "/v1/embeddings", texts, tenant)
        outs = await self._run(request, items)
        return await large_json_response(openai_embeddings(
            [out for out, _ in outs], body.encoding_format,
            self.models.response_model(body.model)))

    async def _openai_inputs(self, value: Any, special: bool
                             ) -> tuple[list[str | None], list[list[int]]]:
        """(texts or None per input, token ids per input) of OpenAI's ``input``."""
        if isinstance(value, str):
            value = [value]
            many = False
        else:
            many = True
        if not value:
            raise ApiError(400, "input must not be an empty list", param="input")
        if isinstance(value[0], int):
            return [None], [list(value)]
        self.tm.text_bounds.check_count(len(value), "input")
        if isinstance(value[0], list):
            return [None] * len(value), [list(v) for v in value]
        for i, text in enumerate(value):
            if not text:
                where = f"input[{i}]" if many else "input"
                raise ApiError(400, f"{where} is an empty string: there is nothing to embed",
                               param="input")
        return list(value), await self.tm.encode_texts(value, special, param="input")

    # --- SGLang's /encode --------------------------------------------------------------------
    async def encode(self, request: Request) -> Response:
        t0 = time.monotonic()
        body = await read_model(request, EncodeRequest)
        self._check_serving()
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        texts, ids_list, batch = await self._native_inputs(body)
        tenant = request_tenant(request)
        namespace = self.tm.namespace(body.extra_key, body.cache_salt, tenant)
        rids = _native_rids(body.rid, len(ids_list), batch)
        items = [self._prepare(ids, rid, namespace, body.priority, tenant, body.log_metrics)
                 for ids, rid in zip(ids_list, rids)]
        rank = self.tm.routed_rank(body)
        for p in items:
            p.msg.routing_key, p.msg.routed_dp_rank = body.routing_key, rank
        self._log_origins(items, "/encode", texts, tenant)
        outs = await self._run(request, items)
        latency = time.monotonic() - t0
        results = [encode_result(client_rid(state.msg.rid), out, latency,
                                 state.weight_version) for out, state in outs]
        if body.return_prompt_token_ids:  # as /generate's
            for r, (_, state) in zip(results, outs):
                r["prompt_token_ids"] = list(state.msg.input_ids)
        return await large_json_response(results if batch else results[0])

    async def _native_inputs(self, body: EncodeRequest
                             ) -> tuple[list[str | None], list[list[int]], bool]:
        text, ids = body.text, body.input_ids
        if (text is None) == (ids is None):
            raise ApiError(400, "give exactly one of text or input_ids", param="text")
        if text is not None:
            texts = text if isinstance(text, list) else [text]
            if not texts:
                raise ApiError(400, "the batch is empty", param="text")
            return (list(texts), await self.tm.encode_texts(texts, True),
                    isinstance(text, list))
        batch = bool(ids) and isinstance(ids[0], list)
        if batch:
            self.tm.text_bounds.check_count(len(ids), "input_ids")
        return ([None] * (len(ids) if batch else 1),
                [list(v) for v in ids] if batch else [list(ids)], batch)

    # --- both ------------------------------------------------------------------------------
    def _prepare(self, ids: list[int], rid: str | None, namespace: str | None,
                 priority: int | None, tenant: str | None, log_metrics: bool) -> Prepared:
        return self.tm.prepare(ids, {"max_new_tokens": 0}, rid, namespace=namespace,
                               log_metrics=log_metrics, priority=priority, tenant=tenant,
                               embedding=True)

    def _log_origins(self, items: list[Prepared], route: str, texts: list[str | None],
                     tenant: str | None) -> None:
        for p, text in zip(items, texts):
            p.origin = self.tm.log_origin(route, text, tenant)

    async def _run(self, request: Request, items: list[Prepared]
                   ) -> list[tuple[TextOutput, ReqState]]:
        """Submit every input at once (one prefill batch where they fit), then wait for
        each one's only output; a client that leaves aborts them."""
        states = await self.tm.submit(items)
        outs = await await_or_disconnect(
            request, asyncio.gather(*[self._final(s) for s in states]))
        return list(zip(outs, states))

    async def _final(self, state: ReqState) -> TextOutput:
        last = None
        async for out in self.tm.outputs(state):
            last = out
        assert last is not None and last.embedding is not None, (
            f"request {state.msg.rid} ended without an embedding: {last}")
        return last


def _rids(rid: str | None, n: int) -> list[str | None]:
    """One rid per input: the client's for one input, ``<rid>-<i>`` for several."""
    if rid is None:
        return [None] * n
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def _native_rids(rid: str | list[str] | None, n: int, batch: bool) -> list[str | None]:
    """SGLang's: a list with one rid per item for a batch, a string for one prompt."""
    if rid is None:
        return [None] * n
    if isinstance(rid, list):
        if not batch or len(rid) != n:
            raise ApiError(400, f"rid must be a list of {n} ids for a batch of {n}, or a "
                           "string for one prompt", param="rid")
        return list(rid)
    if batch:
        raise ApiError(400, "rid must be a list with one id per prompt for a batch",
                       param="rid")
    return [rid]
