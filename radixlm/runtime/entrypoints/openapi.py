"""/openapi.json: FastAPI's generated document with every route's request body taken from
its pydantic model (the native routes', OpenAI's, the Responses API's and the embedding
routes')."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from radixlm.runtime.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EncodeRequest,
)
from radixlm.runtime.entrypoints.openai.responses_protocol import ResponsesRequest
from radixlm.runtime.entrypoints.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    UpdateWeightFromDiskRequest,
)

ROUTE_MODELS: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/abort_request": AbortRequest,
    "/update_weights_from_disk": UpdateWeightFromDiskRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/encode": EncodeRequest,
}


def openapi_schema(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (FastAPI's document) with each of ``ROUTE_MODELS``' request bodies."""
    components = base.setdefault("components", {}).setdefault("schemas", {})
    for path, model in ROUTE_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        op = base.get("paths", {}).get(path, {}).get("post")
        if op is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
    return base
