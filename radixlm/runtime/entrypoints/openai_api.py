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

from radixlm.runtime.entrypoints.http_utils import (
    await_or_disconnect,
    json_response,
    read_json,
    sse_response,
)
from radixlm.runtime.entrypoints.openai_jobs import ChatJob, CompletionJob
from radixlm.runtime.managers.tokenizer_manager import ApiError, TokenizerManager

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
    "logit_bias": "logit_bias",
}


# --- shared by both OpenAI routes ------------------------------------------------------------
class OpenAIRoutes:
    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm = tm
        self.served_model_name = served_model_name
        self.created = int(time.time())
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        known = {self.served_model_name, self.tm.model_path, "default"}
        if model is not None and model not in known:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Served: `{self.served_model_name}`",
                param="model",
                code="model_not_found",
            )

    def sampling_params(self, body: dict[str, Any], max_tokens: Any) -> dict[str, Any]:
        sp = {"max_new_tokens": max_tokens}
        for key, name in _SAMPLING_FIELDS.items():
            if body.get(key) is not None:
                sp[name] = body[key]
        return sp

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def models(self) -> Response:
        ctx = self.tm.server_info["context_length"]
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "radixlm",
                        "root": self.tm.model_path,
                        "max_model_len": ctx,
                    }
                ],
            }
        )

    # --- /v1/completions ------------------------------------------------------------------------
    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tm.encode_text(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self.tm.encode_text(p, "prompt") for p in prompt]
            if all(isinstance(p, int) for p in prompt):
                return [list(prompt)]
            if all(isinstance(p, list) for p in prompt):
                return [list(p) for p in prompt]
        raise ApiError(
            400,
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists",
            param="prompt",
        )

    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body)
        prompts = self._prompts(body.get("prompt"))
        max_tokens = body.get("max_tokens")
        sp = self.sampling_params(
            body, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        )
        logprobs, echo = body.get("logprobs"), bool(body.get("echo"))
        items = [
            self.tm.prepare(
                ids,
                sp,
                return_logprob=logprobs is not None,
                logprob_start_len=0 if echo and logprobs is not None else -1,
                top_logprobs_num=logprobs or 0,
                text_in_logprobs=True,
            )
            for ids in prompts
        ]
        job = CompletionJob(self, items, echo, body)
        states = await self.tm.submit(items)
        if body.get("stream"):
            return sse_response(job.stream(states))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        return json_response(job.response(builders))

    # --- /v1/chat/completions -------------------------------------------------------------------
    def _chat_prompt(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        conv = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a role and content", param="messages")
            content = m.get("content") or ""
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                )
            if not isinstance(content, str):
                raise ApiError(
                    400, "message content must be a string or a list of parts", param="messages"
                )
            conv.append({"role": m["role"], "content": content})
        try:
            text = self.tm.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise ApiError(
                400, f"the chat template failed on these messages: {e}", param="messages"
            ) from None
        return self.tm.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _response_format(body: dict[str, Any], sp: dict[str, Any]) -> None:
        fmt = body.get("response_format")
        if fmt is None:
            return
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            sp["json_schema"] = json.dumps({"type": "object"})
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(
                    400,
                    "response_format.json_schema.schema must be an object",
                    param="response_format",
                )
            sp["json_schema"] = json.dumps(schema)
        elif kind != "text":
            raise ApiError(
                400,
                f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                param="response_format",
            )

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body)
        ids = self._chat_prompt(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = max(self.tm.server_info["context_length"] - len(ids), 1)
        sp = self.sampling_params(body, max_tokens)
        self._response_format(body, sp)
        logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise ApiError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
        item = self.tm.prepare(
            ids, sp, return_logprob=logprobs, top_logprobs_num=top, text_in_logprobs=True
        )
        job = ChatJob(self, item, body)
        states = await self.tm.submit([item])
        if body.get("stream"):
            return sse_response(job.stream(states))
        builders = await await_or_disconnect(
            request, asyncio.gather(*[self.tm.collect(s) for s in states])
        )
        return json_response(job.response(builders))
