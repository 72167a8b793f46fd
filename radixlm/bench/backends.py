"""How one streamed request is sent and timed, per serving API.

- ``radixlm`` / ``sglang``: native ``POST /generate`` with ``stream``; every event carries
  ``meta_info.completion_tokens`` (cumulative), so a chunk of k new tokens adds k equal
  inter-token gaps; ``meta_info.cached_tokens`` and ``prompt_tokens`` are the server's.
- ``openai`` / ``vllm``: ``POST /v1/completions``; ``openai-chat``: ``POST
  /v1/chat/completions``. Streamed with ``stream_options.include_usage`` so the last event
  carries ``usage`` (completion tokens, prompt tokens, and
  ``prompt_tokens_details.cached_tokens`` where the server fills it). The token count of a
  chunk is not sent, so each chunk with text counts as one gap (as SGLang's client does).

Greedy and ``ignore_eos`` by default, so outputs have the requested lengths;
``--extra-request-body`` overrides any field.
"""

from __future__ import annotations

import abc
import json
import time
from typing import Any

import httpx

from radixlm.bench.request import RequestInput, RequestOutput

BACKENDS = ("radixlm", "sglang", "openai", "openai-chat", "vllm")


class Backend(abc.ABC):
    """One API: the request body, and what each streamed event adds."""

    path = ""

    @abc.abstractmethod
    def payload(self, req: RequestInput, model: str | None) -> dict[str, Any]:
        """The JSON body of ``req``."""

    @abc.abstractmethod
    def new_tokens(self, data: dict[str, Any], out: RequestOutput) -> int:
        """Read one event into ``out``; return the output tokens it adds."""

    async def send(self, client: httpx.AsyncClient, req: RequestInput,
                   model: str | None) -> RequestOutput:
        out = RequestOutput()
        out.start_time = last = time.perf_counter()
        try:
            async with client.stream("POST", self.path, json=self.payload(req, model)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    out.error = f"HTTP {resp.status_code}: {body[:500]}"
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    k = self.new_tokens(json.loads(line[5:]), out)
                    now = time.perf_counter()
                    if k and out.ttft == 0.0:
                        out.ttft = now - out.start_time
                    elif k:
                        out.itl += [(now - last) / k] * k
                    if k:
                        last = now
            out.latency = time.perf_counter() - out.start_time
            out.success = out.ttft > 0
            if not out.success:
                out.error = "the stream ended without an output token"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            out.error = f"{type(e).__name__}: {e}"
        return out


class NativeBackend(Backend):
    """SGLang's native API (radixlm serves the same shapes)."""

    path = "/generate"

    def payload(self, req: RequestInput, model: str | None) -> dict[str, Any]:
        sp = {"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0}
        body: dict[str, Any] = {"text": req.prompt, "sampling_params": sp, "stream": True}
        extra = dict(req.extra_body)
        sp.update(extra.pop("sampling_params", {}))
        body.update(extra)
        return body

    def new_tokens(self, data: dict[str, Any], out: RequestOutput) -> int:
        meta = data.get("meta_info") or {}
        n = int(meta.get("completion_tokens", out.output_len))
        out.prompt_len = int(meta.get("prompt_tokens", out.prompt_len))
        if "cached_tokens" in meta:
            out.cached_tokens = int(meta["cached_tokens"])
        out.generated_text = data.get("text", out.generated_text)  # cumulative
        new, out.output_len = n - out.output_len, n
        return max(new, 0)


class CompletionsBackend(Backend):
    """OpenAI ``/v1/completions`` (also vLLM's and SGLang's OpenAI-compatible routes)."""

    path = "/v1/completions"

    def request_fields(self, req: RequestInput) -> dict[str, Any]:
        return {"prompt": req.prompt}

    def payload(self, req: RequestInput, model: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            **self.request_fields(req),
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        body.update(req.extra_body)
        return body

    def chunk_text(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""

    def new_tokens(self, data: dict[str, Any], out: RequestOutput) -> int:
        usage = data.get("usage")
        if usage:
            out.prompt_len = int(usage.get("prompt_tokens", out.prompt_len))
            out.output_len = int(usage.get("completion_tokens", out.output_len))
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                out.cached_tokens = int(details["cached_tokens"])
        text = "".join(self.chunk_text(c) for c in data.get("choices") or [])
        out.generated_text += text
        return 1 if text else 0


class ChatBackend(CompletionsBackend):
    path = "/v1/chat/completions"

    def request_fields(self, req: RequestInput) -> dict[str, Any]:
        return {"messages": req.messages}

    def chunk_text(self, choice: dict[str, Any]) -> str:
        delta = choice.get("delta") or {}
        return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


def make_backend(name: str) -> Backend:
    table: dict[str, type[Backend]] = {
        "radixlm": NativeBackend, "sglang": NativeBackend, "openai": CompletionsBackend,
        "vllm": CompletionsBackend, "openai-chat": ChatBackend,
    }
    if name not in table:
        raise ValueError(f"--backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return table[name]()
