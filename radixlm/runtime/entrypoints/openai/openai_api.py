"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Extra sampling fields are accepted as SGLang and vLLM accept them (top_k, min_p,
ignore_eos, stop_token_ids, repetition_penalty, min_tokens, regex, json_schema, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response

from radixlm.runtime.entrypoints.auth import request_tenant
from radixlm.runtime.entrypoints.http_utils import (
    await_or_disconnect,
    json_response,
    large_json_response,
    read_model,
    sse_response,
)
from radixlm.runtime.entrypoints.openai import chat_prompt
from radixlm.runtime.entrypoints.openai.openai_jobs import ChatJob, CompletionJob
from radixlm.runtime.entrypoints.primed import prime
from radixlm.runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISampling,
    ResponseFormat,
    custom_labels_from_header,
)
from radixlm.runtime.entrypoints.server_info import public_model_name
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.tokenizer_manager.admission import Prepared
from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import TokenizerManager

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
    "ebnf": "ebnf",
    "stop_regex": "stop_regex",
    "logit_bias": "logit_bias",
}
# the shared checks (``validate_request``) name SGLang's fields; each route's own names
_COMPLETION_FIELDS = {"input_ids": "prompt", "max_new_tokens": "max_tokens",
                      "min_new_tokens": "min_tokens", "top_logprobs_num": "logprobs"}
_CHAT_FIELDS = {"input_ids": "messages", "max_new_tokens": "max_tokens",
                "min_new_tokens": "min_tokens", "top_logprobs_num": "top_logprobs"}


@contextlib.contextmanager
def fields_named(names: dict[str, str]) -> Iterator[None]:
    """A 400 raised inside names the route's field (``prompt``) where the shared checks
    name SGLang's (``input_ids``), in ``param`` and at the start of the message."""
    try:
        yield
    except ApiError as e:
        field = names.get(e.param or "")
        if field is None:
            raise
        message = e.message
        if message.startswith(e.param or ""):
            message = field + message[len(e.param or ""):]
        raise ApiError(e.status, message, e.type, field, e.code) from None


# --- shared by both OpenAI routes ------------------------------------------------------------
class OpenAIRoutes:
    """``sglang_model_id``: SGLang's id of the model (``--served-model-name``, else the
    checkpoint's path, which SGLang's tools load a tokenizer from), shown to the admin;
    ``served_model_name``: the name shown to tenants and in responses to requests that
    name no model (``public_model_name``: never a path)."""

    def __init__(self, tm: TokenizerManager, sglang_model_id: str) -> None:
        self.tm = tm
        self.sglang_model_id = sglang_model_id
        self.served_model_name = public_model_name(tm.args, tm.model_path)
        self.created = int(time.time())
        self._special: frozenset[str] | None = None  # the tokenizer's special tokens
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    def model_id(self, tenant: str | None) -> str:
        """The model's id as ``tenant`` may see it (None: not a tenant)."""
        return self.served_model_name if tenant is not None else self.sglang_model_id

    def check_model(self, model: str | None, tenant: str | None = None) -> None:
        """404 unless ``model`` is None or one of the served model's names; its path
        is one only for callers that may see it (no oracle for a tenant's guess)."""
        # "unknown": what sglang-router puts in a request that named no model
        known = {self.served_model_name, self.model_id(tenant), "default", "unknown"}
        if tenant is None:
            known.add(self.tm.model_path)
        if model is not None and model not in known:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Served: `{self.model_id(tenant)}`",
                param="model",
                code="model_not_found",
            )

    def response_model(self, asked: str | None) -> str:
        """A response's ``model``: the name the request gave (SGLang's), else ours."""
        return asked if asked is not None else self.served_model_name

    @staticmethod
    def sampling_params(body: OpenAISampling, max_tokens: int) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": max_tokens}
        for key, name in _SAMPLING_FIELDS.items():
            value = getattr(body, key)
            if value is not None:
                sp[name] = value
        return sp

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _model_card(self, tenant: str | None) -> dict[str, Any]:
        return {
            "id": self.model_id(tenant),
            "object": "model",
            "created": self.created,
            "owned_by": "radixlm",
            "root": self.served_model_name if tenant is not None else self.tm.model_path,
            "max_model_len": self.tm.server_info["context_length"],
        }

    async def model(self, request: Request, model_id: str) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the served model's card, else 404."""
        tenant = request_tenant(request)
        self.check_model(model_id, tenant)  # the served model's names, else 404
        return json_response(self._model_card(tenant))

    async def models(self, request: Request) -> Response:
        return json_response(
            {
                "object": "list",
                "data": [self._model_card(request_tenant(request))],
            }
        )

    # --- /v1/completions ------------------------------------------------------------------------
    async def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self.tm.encode_text(prompt, param="prompt")]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], str):
            return await self.tm.encode_texts(prompt, param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        self.tm.text_bounds.check_count(len(prompt), "prompt")
        return [list(p) for p in prompt]

    def _custom_labels(self, request: Request) -> dict[str, Any] | None:
        """SGLang's custom metric labels header (a JSON object), allowed names only."""
        args = self.tm.args
        return custom_labels_from_header(
            request.headers.get(args.tokenizer_metrics_custom_labels_header),
            self.tm.metrics.custom_labels)

    def _prepare_completion(self, request: Request, body: CompletionRequest, ids: list[int],
                            sp: dict[str, Any]) -> Prepared:
        logprobs = body.logprobs
        return self.tm.prepare(
            ids,
            sp,
            return_logprob=logprobs is not None,
            logprob_start_len=0 if body.echo and logprobs is not None else -1,
            top_logprobs_num=logprobs or 0,
            text_in_logprobs=True,
            namespace=self.tm.namespace(body.extra_key, body.cache_salt,
                                        request_tenant(request)),
            priority=body.priority,
            custom_labels=self._custom_labels(request),
            tenant=request_tenant(request),  # its rids are scoped (tenant_rids)
        )

    async def completions(self, request: Request) -> Response:
        body = await read_model(request, CompletionRequest)
        _refuse_unsupported(body)
        self.check_model(body.model, request_tenant(request))
        prompts = await self._prompts(body.prompt)
        max_tokens = body.max_tokens
        sp = self.sampling_params(
            body, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        )
        with fields_named(_COMPLETION_FIELDS):
            items = [self._prepare_completion(request, body, ids, sp) for ids in prompts]
        texts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        for item, text in zip(items, texts):
            item.origin = self.tm.log_origin("/v1/completions",
                                             text if isinstance(text, str) else None,
                                             request_tenant(request), bool(body.stream))
        self.tm.attach_routing(items, body)
        job = CompletionJob(self, items, body.echo, body)
        states = await self.tm.submit(items)
        if body.stream:  # the status waits for every request's first output or error
            return sse_response(job.stream(await prime(request, self.tm, states)))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        return await large_json_response(job.response(builders))

    # --- /v1/chat/completions -------------------------------------------------------------------
    async def _chat_prompt(self, body: ChatCompletionRequest, tools: list[Any] | None
                           ) -> tuple[str, list[int]]:
        """The rendered chat template and its ids; 400 past ``--max-chat-messages``
        messages or for content that cannot fit the context, before the template runs."""
        bounds = self.tm.text_bounds
        bounds.check_messages(len(body.messages))
        conv = chat_prompt.conversation(body.messages)
        bounds.check_text(chat_prompt.conversation_text(conv) + json.dumps(tools or []),
                          "messages")
        text = await self.tm.tokenize_pool.render_chat(
            conv, tools=tools, template_kwargs=chat_prompt.template_kwargs(body))
        return text, await self.tm.encode_text(text, param="messages")

    @staticmethod
    def _response_format(fmt: ResponseFormat | None, sp: dict[str, Any]) -> None:
        if fmt is None or fmt.type == "text":
            return
        if fmt.type == "json_object":
            sp["json_schema"] = json.dumps({"type": "object"})
            return
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if schema is None:
            raise ApiError(
                400,
                "response_format.json_schema.schema must be an object",
                param="response_format",
            )
        sp["json_schema"] = json.dumps(schema)

    def _default_max_tokens(self, prompt_len: int) -> int:
        """What is left of the context, bounded by what the KV pool could ever hold."""
        limits = self.tm.limits
        room = min(limits.context_len, limits.pool_size - limits.pool_size % limits.page_size)
        return max(room - prompt_len, 1)

    async def chat(self, request: Request) -> Response:
        body = await read_model(request, ChatCompletionRequest)
        job, states = await self.start_chat(request, body, "/v1/chat/completions")
        if body.stream:  # the status waits for every request's first output or error
            return sse_response(job.stream(await prime(request, self.tm, states)))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        return await large_json_response(job.response(builders))

    async def start_chat(self, request: Request, body: ChatCompletionRequest, route: str
                         ) -> tuple[ChatJob, list[Any]]:
        """Check ``body``, render its conversation and submit it: the job that shapes its
        outputs and the request's state (``/v1/responses`` translates into this too)."""
        _refuse_unsupported(body)
        if body.top_logprobs and not body.logprobs:  # OpenAI's and vLLM's 400
            raise ApiError(400, f"top_logprobs ({body.top_logprobs}) needs logprobs: true",
                           param="top_logprobs")
        tenant = request_tenant(request)
        self.check_model(body.model, tenant)
        args = self.tm.args
        plan = chat_prompt.tool_plan(body, args.tool_call_parser)
        prompt, ids = await self._chat_prompt(body, plan.template_tools if plan else None)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(len(ids))
        sp = self.sampling_params(body, max_tokens)
        self._response_format(body.response_format, sp)
        if self._special is None:
            self._special = chat_prompt.special_token_texts(self.tm.tokenizer)
        chat_prompt.constrain(plan, sp, self._special)
        outputs = chat_prompt.choice_outputs(body, plan, args.reasoning_parser, prompt, sp)
        names = {**_CHAT_FIELDS, "max_new_tokens": "max_completion_tokens"
                 if body.max_completion_tokens is not None else "max_tokens"}
        with fields_named(names):
            item = self.tm.prepare(
                ids, sp, return_logprob=body.logprobs,
                top_logprobs_num=body.top_logprobs or 0, text_in_logprobs=True,
                priority=body.priority,
                namespace=self.tm.namespace(body.extra_key, body.cache_salt, tenant),
                custom_labels=self._custom_labels(request), tenant=tenant,
            )
        item.origin = self.tm.log_origin(
            route,
            [{"role": m["role"], "content": m["content"]}
             for m in chat_prompt.conversation(body.messages)],
            tenant, bool(body.stream))
        self.tm.attach_routing([item], body)
        job = ChatJob(self, item, body, outputs)
        return job, await self.tm.submit([item])


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming an OpenAI feature the request asks for and radixlm lacks (tools,
    suffix, audio, ...), rather than an answer that silently ignores it."""
    refused = body.unsupported()
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
