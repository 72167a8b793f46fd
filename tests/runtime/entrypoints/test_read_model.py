"""read_model: small bodies are parsed on the event loop, large ones on a worker thread
(validating an 8 MB chat takes seconds, which would stall every other connection)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from pydantic import BaseModel, field_validator

from radixlm.runtime.entrypoints.http_utils import PARSE_ON_LOOP_BYTES, read_model
from radixlm.runtime.managers.api_error import ApiError

PARSERS: list[threading.Thread] = []


class Body(BaseModel):
    text: str

    @field_validator("text")
    @classmethod
    def _record(cls, value: str) -> str:
        PARSERS.append(threading.current_thread())
        if value == "bad":
            raise ValueError("text must not be 'bad'")
        return value


class FakeRequest:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def body(self) -> bytes:
        return self._body


def _parse(text: str) -> tuple[Body, threading.Thread]:
    PARSERS.clear()
    body = json.dumps({"text": text}).encode()
    return asyncio.run(read_model(FakeRequest(body), Body)), PARSERS[-1]  # type: ignore[arg-type]


def test_small_bodies_parse_on_the_loop_large_ones_off_it():
    parsed, thread = _parse("hello")
    assert parsed.text == "hello" and thread is threading.main_thread()
    big = "x" * (PARSE_ON_LOOP_BYTES + 1)
    parsed, thread = _parse(big)
    assert parsed.text == big and thread is not threading.main_thread()


def test_a_large_bad_body_is_still_a_400():
    body = json.dumps({"text": "bad", "pad": "y" * PARSE_ON_LOOP_BYTES}).encode()

    class Strict(Body):
        model_config = {"extra": "ignore"}

    with pytest.raises(ApiError) as e:
        asyncio.run(read_model(FakeRequest(body), Strict))  # type: ignore[arg-type]
    assert e.value.status == 400 and "bad" in str(e.value.body())
