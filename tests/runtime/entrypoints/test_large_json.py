"""Large JSON answers are encoded off the event loop (``http_utils.large_json_response``,
``off_loop``), in pieces: 16 clients reading their 7 MB stored input items pushed
``/health`` to 353 ms when the encoding ran on the loop (issue 55). Also the Responses
routes: a response is encoded for the store, and its input items joined, on the JSON
thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import msgspec
import pytest
from starlette.requests import Request

from radixlm.runtime.entrypoints import http_utils
from radixlm.runtime.entrypoints.http_utils import encode_json, large_json_response
from radixlm.runtime.entrypoints.openai import responses_api
from radixlm.runtime.entrypoints.openai.responses_api import ResponsesRoutes, Turn
from radixlm.runtime.entrypoints.openai.responses_protocol import ResponsesRequest
from radixlm.runtime.entrypoints.openai.responses_store import ResponseStore
from radixlm.runtime.entrypoints.openai.responses_stream import ResponseEvents

BIG = {"object": "list", "data": [
    {"id": f"msg_{i}", "type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "é\n\"x" * 50}],
     "scores": list(range(300))} for i in range(1000)], "meta": {1: "int key"}}


@pytest.fixture
def encoders(monkeypatch) -> list[threading.Thread]:
    """The threads that ran each piece of JSON encoding."""
    seen: list[threading.Thread] = []
    real = http_utils._encode_piece

    def recording(obj):
        seen.append(threading.current_thread())
        return real(obj)

    monkeypatch.setattr(http_utils, "_encode_piece", recording)
    return seen


def test_pieces_make_the_same_bytes():
    for obj in (BIG, [], {}, [[1, [2, [3, [4, [5, [6, [7]]]]]]]], list(range(1000)), "s", None):
        assert encode_json(obj) == msgspec.json.encode(obj)


def test_a_large_body_is_encoded_off_the_loop(encoders):
    async def main() -> tuple[bytes, threading.Thread]:
        response = await large_json_response(BIG)
        return bytes(response.body), threading.current_thread()

    body, loop_thread = asyncio.run(main())
    assert msgspec.json.decode(body) == msgspec.json.decode(msgspec.json.encode(BIG))
    assert len(encoders) > 3 and loop_thread not in encoders  # in pieces


def test_the_loop_runs_while_a_body_is_encoded(monkeypatch):
    """An injected encoder that waits for the loop: it finishes only if the loop keeps
    running while it encodes (on the loop it would wait its whole timeout and fail)."""
    ticked = threading.Event()
    real = http_utils._encode_piece

    def waits_for_the_loop(obj):
        assert ticked.wait(timeout=30), "the event loop did not run during the encoding"
        return real(obj)

    monkeypatch.setattr(http_utils, "_encode_piece", waits_for_the_loop)

    async def tick() -> None:
        await asyncio.sleep(0)
        ticked.set()

    async def main() -> bytes:
        response, _ = await asyncio.gather(large_json_response({"a": [1, 2]}), tick())
        return bytes(response.body)

    assert msgspec.json.decode(asyncio.run(main())) == {"a": [1, 2]}


def _request(query: bytes = b"") -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "headers": [],
                    "query_string": query, "state": {}})


def test_responses_are_stored_and_listed_off_the_loop(encoders, monkeypatch):
    """``Turn.keep`` encodes the response, conversation and input items on the JSON thread;
    ``input_items`` joins the stored items there; ``GET`` sends the stored bytes as they
    are (nothing to encode)."""
    pages: list[threading.Thread] = []
    real_page = responses_api.items_page

    def recording_page(entry, desc):
        pages.append(threading.current_thread())
        return real_page(entry, desc)

    monkeypatch.setattr(responses_api, "items_page", recording_page)
    store = ResponseStore(16, 1 << 30)
    routes = ResponsesRoutes(SimpleNamespace(), store)
    items = BIG["data"][:100]
    body = ResponsesRequest.model_validate({"input": "x"})
    response = {"id": "resp_1", "status": "completed", "output": [
        {"id": "msg_o", "type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "y" * 1000, "annotations": []}]}]}

    async def main():
        turn = Turn(routes, _request(), body, response, [{"role": "user", "content": "x"}],
                    items)
        kept = await turn.keep()
        got = await routes.retrieve(_request(), "resp_1")
        listed = await routes.input_items(_request(b"order=asc"), "resp_1")
        return kept, got, listed, threading.current_thread()

    kept, got, listed, loop_thread = asyncio.run(main())
    assert encoders and loop_thread not in encoders
    assert pages and loop_thread not in pages
    assert msgspec.json.decode(kept)["id"] == "resp_1" and got.body == kept
    page = msgspec.json.decode(listed.body)
    assert page["data"] == items and page["first_id"] == "msg_0" and not page["has_more"]


def test_a_streams_closing_events_are_encoded_in_pieces(encoders):
    """The terminal event carries the whole response: ``finish`` encodes it in pieces (and
    ``Turn.stream`` runs it on the JSON thread), so the thread gives the GIL back."""
    events = ResponseEvents({"id": "resp_1", "output": []}, want_logprobs=False)
    events.delta({"content": "x" * 1000}, None)
    assert not encoders  # deltas: one small encode each, on the loop
    chunks = events.finish("completed", {"output_tokens": 1}, None)
    assert len(encoders) > len(chunks)
    final = msgspec.json.decode(chunks[-1].split(b"\ndata: ", 1)[1])
    assert final["response"]["output"][0]["content"][0]["text"] == "x" * 1000
