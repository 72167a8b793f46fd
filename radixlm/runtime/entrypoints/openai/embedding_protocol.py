"""Request models and response shapes of the embedding routes (``--is-embedding``).

``EmbeddingRequest`` is OpenAI's ``/v1/embeddings`` body (with vLLM's and SGLang's
extras), ``EncodeRequest`` SGLang's native ``/encode`` body (its ``EmbeddingReqInput``).
Both are parsed strictly, as ``protocol.py``'s models; ``encode_result`` and
``openai_embeddings`` shape the answers as SGLang and OpenAI do. The Engine's ``encode``
uses the same shapes.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from radixlm.runtime.entrypoints.protocol import Count, Int64, TokenId
from radixlm.runtime.entrypoints.refused_fields import REFUSED_REQUEST_FIELDS, drop_neutral

DIMENSIONS_REFUSED = ("dimensions is not supported: the served model is a decoder whose "
                      "embeddings have the fixed width of its hidden size (no Matryoshka "
                      "training); leave it out")
# SGLang's embedding fields radixlm refuses unless null / false
_OVERRIDES = "radixlm takes text or token ids, not embedding overrides"
REFUSED_EMBEDDING_FIELDS = {
    "embed_override_token_id": _OVERRIDES,
    "embed_overrides": _OVERRIDES,
    "lora_path": "radixlm does not serve LoRA adapters",
    "return_pooled_hidden_states": "radixlm returns the pooled embedding only",
    "decision_layout": "radixlm has no multi-item scoring",
}
EMBEDDING_ON_GENERATION = ("The model does not support the Embeddings API: this server "
                           "generates text; start it with --is-embedding to serve "
                           "embeddings")


class EmbeddingRequest(BaseModel):
    """OpenAI's ``/v1/embeddings``: ``input`` is a string, a list of strings, a list of
    token ids or a list of such lists. Unknown fields are ignored, as on the other OpenAI
    routes; the ones radixlm cannot honour are a 400 (``unsupported``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None  # accepted, as OpenAI's; radixlm keeps no per-user state
    # vLLM's extras
    add_special_tokens: bool = True  # as sentence-transformers tokenizes (e.g. a final EOS)
    truncate_prompt_tokens: Int64 | None = None
    normalize: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    # SGLang's
    rid: str | None = None
    lora_path: Any = None
    embed_override_token_id: Any = None
    embed_overrides: Any = None

    def unsupported(self, server_normalizes: bool) -> tuple[str, str] | None:
        """(field, why) of a field set to something radixlm does not do."""
        refused = _refused(self)
        if refused is not None:
            return refused
        if self.dimensions is not None:
            return "dimensions", DIMENSIONS_REFUSED
        if self.truncate_prompt_tokens is not None:
            return "truncate_prompt_tokens", ("truncate_prompt_tokens is not supported: "
                                              "send the tokens to embed")
        if self.normalize is not None and self.normalize != server_normalizes:
            return "normalize", (f"normalize is {str(server_normalizes).lower()} for this "
                                 "server (the checkpoint's pooling config); it cannot be "
                                 "changed per request")
        return None


class EncodeRequest(BaseModel):
    """SGLang's ``/encode`` body (``EmbeddingReqInput``): one prompt or a batch, as text
    or token ids. Its other fields are refused by ``REFUSED_REQUEST_FIELDS`` (media,
    LoRA, ...) or unknown (400)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    rid: str | list[str] | None = None
    # SGLang's "dummy sampling params for compatibility": only {} (or max_new_tokens 0)
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    dimensions: Count | None = None
    priority: int | None = None
    routing_key: str | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    log_metrics: bool = True
    is_cross_encoder_request: bool = False
    extra_key: str | None = None  # radixlm's cache namespaces, as /generate
    cache_salt: str | None = None
    model: str | None = None  # sglang-router sends it; ignored, as /generate does
    return_prompt_token_ids: bool = False  # each item's "prompt_token_ids", as /generate
    # refused unless null / false (REFUSED_EMBEDDING_FIELDS)
    embed_override_token_id: Any = None
    embed_overrides: Any = None
    return_pooled_hidden_states: bool = False
    decision_layout: Any = None

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        return drop_neutral(data, REFUSED_REQUEST_FIELDS)

    def unsupported(self) -> tuple[str, str] | None:
        refused = _refused(self)
        if refused is not None:
            return refused
        if self.dimensions is not None:
            return "dimensions", DIMENSIONS_REFUSED
        if self.is_cross_encoder_request:
            return "is_cross_encoder_request", ("is_cross_encoder_request is not supported: "
                                                "radixlm serves no cross-encoder (reranker)")
        sps = self.sampling_params
        for sp in sps if isinstance(sps, list) else [sps or {}]:
            if any(k != "max_new_tokens" or type(v) is not int or v != 0
                   for k, v in sp.items()):
                return "sampling_params", ("sampling_params: an embedding request samples "
                                           "nothing; send {} or leave it out")
        return None


def _refused(body: BaseModel) -> tuple[str, str] | None:
    for name, why in REFUSED_EMBEDDING_FIELDS.items():
        if getattr(body, name, None) not in (None, False):
            return name, f"{name} is not supported: {why}"
    return None


def embedding_floats(data: bytes) -> list[float]:
    """The embedding bytes (little-endian float32) as JSON floats."""
    return np.frombuffer(data, dtype="<f4").astype(np.float64).tolist()


def encode_result(rid: str, out: Any, latency: float, weight_version: str) -> dict[str, Any]:
    """SGLang's ``/encode`` item: ``embedding`` and ``meta_info`` (``out``: the request's
    final TextOutput or ReqOutput)."""
    assert out.embedding is not None, f"request {rid} finished without an embedding"
    return {"embedding": embedding_floats(out.embedding),
            "meta_info": {"id": rid, "finish_reason": out.finish_reason,
                          "prompt_tokens": out.prompt_tokens,
                          "cached_tokens": out.cached_tokens,
                          "weight_version": weight_version, "e2e_latency": latency}}


def openai_embeddings(outs: list[Any], encoding_format: str, model: str) -> dict[str, Any]:
    """OpenAI's ``/v1/embeddings`` answer; base64 is the float32 bytes, as OpenAI's."""
    data = []
    for i, out in enumerate(outs):
        vector: Any = (base64.b64encode(out.embedding).decode() if encoding_format == "base64"
                       else embedding_floats(out.embedding))
        data.append({"object": "embedding", "index": i, "embedding": vector})
    prompt_tokens = sum(out.prompt_tokens for out in outs)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

