"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Extra sampling fields are accepted as SGLang and vLLM accept them (top_k, min_p,
ignore_eos, stop_token_ids, repetition_penalty, min_tokens, regex, json_schema, ...).
"""

from __future__ import annotations

import asyncio
import json
import time
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
from radixlm.runtime.managers.api_error import ApiError
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


# --- shared by both OpenAI routes ------------------------------------------------------------
class OpenAIRoutes:
    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm = tm
        self.served_model_name = served_model_name
        self.created = int(time.time())
        self._special: frozenset[str] | None = None  # the tokenizer's special tokens
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    def check_model(self, model: str | None) -> None:
        # "unknown": what sglang-router puts in a request that named no model
        known = {self.served_model_name, self.tm.model_path, "default", "unknown"}
        if model is not None and model not in known:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Served: `{self.served_model_name}`",
                param="model",
                code="model_not_found",
            )

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

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixlm",
            "root": self.tm.model_path,
            "max_model_len": self.tm.server_info["context_length"],
        }

    async def model(self, model_id: str) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the served model's card, else 404."""
        if model_id != self.served_model_name:
            self.check_model(model_id)  # the served model's other names, else 404
        return json_response(self._model_card())

    async def models(self) -> Response:
        return json_response(
            {
                "object": "list",
                "data": [self._model_card()],
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

    async def completions(self, request: Request) -> Response:
        body = await read_model(request, CompletionRequest)
        _refuse_unsupported(body)
        self.check_model(body.model)
        prompts = await self._prompts(body.prompt)
        max_tokens = body.max_tokens
        sp = self.sampling_params(
            body, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        )
        logprobs = body.logprobs
        items = [
            self.tm.prepare(
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
            for ids in prompts
        ]
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
        self.check_model(body.model)
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
        item = self.tm.prepare(
            ids, sp, return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
            text_in_logprobs=True, priority=body.priority,
            namespace=self.tm.namespace(body.extra_key, body.cache_salt, request_tenant(request)),
            custom_labels=self._custom_labels(request), tenant=request_tenant(request),
        )
        item.origin = self.tm.log_origin(
            route,
            [{"role": m["role"], "content": m["content"]}
             for m in chat_prompt.conversation(body.messages)],
            request_tenant(request), bool(body.stream))
        self.tm.attach_routing([item], body)
        job = ChatJob(self, item, body, outputs)
        return job, await self.tm.submit([item])


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming an OpenAI feature the request asks for and radixlm lacks (tools,
    suffix, audio, ...), rather than an answer that silently ignores it."""
    refused = body.unsupported()
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
