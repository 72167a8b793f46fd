"""``radixlm serve --is-embedding``: OpenAI's /v1/embeddings through the official client
(float and base64), LangChain's OpenAIEmbeddings and LiteLLM, and SGLang's /encode, each
equal to transformers' pooled hidden states; the 400s of what it does not serve."""

from __future__ import annotations

import base64
import inspect
import json

import httpx
import numpy as np
import openai
import pytest

from radixlm.runtime.entrypoints.engine.engine import Engine
from radixlm.runtime.entrypoints.openai.embedding_protocol import EmbeddingRequest, EncodeRequest
from radixlm.runtime.entrypoints.refused_fields import REFUSED_REQUEST_FIELDS
from tests.compat.agent_frameworks import run_client
from tests.runtime.embedding_oracle import TOLERANCE, embed, max_error, token_ids
from tests.runtime.entrypoints.test_sglang_parity import _class, _fields

TEXTS = ["The capital of France is Paris.", "hi",
         "Once upon a time, a fox and a crow argued about cheese for a long while."]


@pytest.fixture(scope="module")
def server(module_server, tiny_qwen2_dir):
    return module_server(["--model-path", str(tiny_qwen2_dir), "--is-embedding",
                          "--dtype", "float32", "--chunked-prefill-size", "8",
                          "--max-total-tokens", "4096", "--random-seed", "0",
                          "--log-level", "warning"], "embeddings")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _assert_equal(model_dir, vectors, texts) -> None:
    for vec, text in zip(vectors, texts, strict=True):
        err = max_error(list(vec), embed(model_dir, token_ids(model_dir, text)))
        assert err < TOLERANCE, (text, err)


def test_openai_client_float_and_base64(client, server, tiny_qwen2_dir):
    floats = client.embeddings.create(model="default", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    _assert_equal(tiny_qwen2_dir, [d.embedding for d in floats.data], TEXTS)
    assert floats.usage.prompt_tokens == sum(len(token_ids(tiny_qwen2_dir, t)) for t in TEXTS)
    assert floats.usage.total_tokens == floats.usage.prompt_tokens
    one = client.embeddings.create(model="default", input=TEXTS[0])  # the client asks base64
    _assert_equal(tiny_qwen2_dir, [one.data[0].embedding], TEXTS[:1])
    raw = _post(server, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})
    data = raw.json()["data"][0]["embedding"]
    _assert_equal(tiny_qwen2_dir, [np.frombuffer(base64.b64decode(data), "<f4")], TEXTS[1:2])


def test_token_id_inputs(client, tiny_qwen2_dir):
    ids = [token_ids(tiny_qwen2_dir, t) for t in TEXTS]
    single = client.embeddings.create(model="default", input=ids[0], encoding_format="float")
    assert max_error(single.data[0].embedding, embed(tiny_qwen2_dir, ids[0])) < TOLERANCE
    many = client.embeddings.create(model="default", input=ids[1:], encoding_format="float")
    for got, want in zip(many.data, ids[1:], strict=True):
        assert max_error(got.embedding, embed(tiny_qwen2_dir, want)) < TOLERANCE
    assert many.usage.prompt_tokens == len(ids[1]) + len(ids[2])


def test_native_encode_and_cache_hit(server, tiny_qwen2_dir):
    text = TEXTS[2] + " And then?"
    n = len(token_ids(tiny_qwen2_dir, text))
    first = _post(server, "/encode", {"text": text, "rid": "e1"}).json()
    assert first["meta_info"]["id"] == "e1" and first["meta_info"]["prompt_tokens"] == n
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    again = _post(server, "/encode", {"text": text}).json()
    assert again["meta_info"]["cached_tokens"] == n - 1  # all but the pooled last token
    _assert_equal(tiny_qwen2_dir, [first["embedding"], again["embedding"]], [text, text])
    batch = _post(server, "/encode", {"text": TEXTS, "rid": ["a", "b", "c"]}).json()
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b", "c"]
    _assert_equal(tiny_qwen2_dir, [r["embedding"] for r in batch], TEXTS)
    ids = token_ids(tiny_qwen2_dir, TEXTS[0])
    by_ids = _post(server, "/encode", {"input_ids": [ids], "return_prompt_token_ids": True})
    _assert_equal(tiny_qwen2_dir, [by_ids.json()[0]["embedding"]], TEXTS[:1])
    assert by_ids.json()[0]["prompt_token_ids"] == ids


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_what_an_embedding_server_refuses(server, client):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="default", input="x", dimensions=8)
    assert _error(_post(server, "/v1/embeddings", {"input": ""}))["param"] == "input"
    assert _error(_post(server, "/v1/embeddings", {"input": []}))["param"] == "input"
    assert _error(_post(server, "/v1/embeddings", {"input": "x", "model": "gpt-4"}),
                  404)["param"] == "model"
    assert _error(_post(server, "/v1/embeddings", {"input": "x", "embed_overrides": [[0.5]]})
                  )["param"] == "embed_overrides"
    for body in ({"text": "x", "sampling_params": {"temperature": 0.5}},
                 {"text": "x", "dimensions": 4}, {"text": "x", "image_data": "a.png"},
                 {"text": ["x"], "rid": "one"}, {"text": "x", "lora_path": "a"}):
        _error(_post(server, "/encode", body))
    for path, body in (("/generate", {"text": "x"}),
                       ("/v1/completions", {"model": "default", "prompt": "x"}),
                       ("/v1/chat/completions",
                        {"model": "default", "messages": [{"role": "user", "content": "x"}]})):
        assert "--is-embedding" in _error(_post(server, path, body))["message"]
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(server.url + "/get_model_info").json()["is_generation"] is False
    metrics = httpx.get(server.url + "/metrics").text
    assert 'sglang:prompt_tokens_total{' in metrics
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, model in (("/v1/embeddings", "EmbeddingRequest"), ("/encode", "EncodeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}


def test_embeddings_name_the_input_and_the_model_asked_for(server, tiny_qwen2_dir):
    """An id outside the vocabulary names ``input`` (the field the client sent), and the
    answer's ``model`` is the name asked for, else the served name, never a path."""
    for value in ([5, 10**6], [[5], [10**6]]):
        err = _error(_post(server, "/v1/embeddings", {"input": value}))
        assert err["param"] == "input" and err["message"].startswith("input holds"), err
    for asked, model in (("default", "default"), (None, tiny_qwen2_dir.name)):
        body = {"input": "x"} if asked is None else {"input": "x", "model": asked}
        resp = _post(server, "/v1/embeddings", body)
        assert resp.json()["model"] == model and str(tiny_qwen2_dir) not in resp.text


def test_langchain_and_litellm(server, tiny_qwen2_dir):
    result = run_client("""
        import json, os
        import litellm
        from langchain_openai import OpenAIEmbeddings
        texts = json.loads(TEXTS_JSON)
        lc = OpenAIEmbeddings(model="default", check_embedding_ctx_length=False,
                              tiktoken_enabled=False)
        docs = lc.embed_documents(texts)
        query = lc.embed_query(texts[0])
        resp = litellm.embedding(model="openai/default", input=texts,
                                 api_base=os.environ["OPENAI_BASE_URL"], api_key="EMPTY")
        print("RESULT " + json.dumps({"docs": docs, "query": query,
                                      "litellm": [d["embedding"] for d in resp.data],
                                      "tokens": resp.usage.prompt_tokens}))
    """.replace("TEXTS_JSON", repr(json.dumps(TEXTS))), server.url)
    _assert_equal(tiny_qwen2_dir, result["docs"], TEXTS)
    _assert_equal(tiny_qwen2_dir, [result["query"]], TEXTS[:1])
    _assert_equal(tiny_qwen2_dir, result["litellm"], TEXTS)
    assert result["tokens"] == sum(len(token_ids(tiny_qwen2_dir, t)) for t in TEXTS)


def test_every_sglang_embedding_field_is_decided():
    """SGLang's EmbeddingReqInput (/encode), its OpenAI EmbeddingRequest and Engine.encode,
    read from its source: each field is accepted or refused by name."""
    native = _fields(_class("srt/managers/io_struct.py", "EmbeddingReqInput"))
    assert {"text", "input_ids", "dimensions"} <= set(native)
    assert [f for f in native if f not in EncodeRequest.model_fields
            and f not in REFUSED_REQUEST_FIELDS] == []
    openai_fields = _fields(_class("srt/entrypoints/openai/protocol.py", "EmbeddingRequest"))
    assert [f for f in openai_fields if f not in EmbeddingRequest.model_fields] == []
    engine = _class("srt/entrypoints/engine.py", "Engine")
    encode = next(n for n in engine.body if getattr(n, "name", None) == "encode")
    ours = inspect.signature(Engine.encode).parameters
    assert [a.arg for a in encode.args.args[1:] + encode.args.kwonlyargs
            if a.arg not in ours and a.arg not in REFUSED_REQUEST_FIELDS] == []
