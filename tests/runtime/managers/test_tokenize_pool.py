"""Tokenization in the server process stays off the event loop, fair, and bounded.

The loop's freedom is checked with gates, not clocks: a gated tokenizer's ``encode`` waits
until a callback that the test scheduled on the event loop has run, which it can only do
while the encode runs elsewhere (inline, it waits for ever: the guard's timeout ends it)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.tokenizer_manager.tokenize_pool import (
    INLINE_CHARS,
    TextBounds,
    TokenizePool,
    chars_per_token,
)
from radixlm.runtime.tokenizer import load_tokenizer

GUARD_S = 20.0  # a deadlock guard: a correct pool never waits on it


class GatedTokenizer:
    """Encodes texts starting with a held prefix only once that prefix's gate is set."""

    def __init__(self, real) -> None:
        self.real = real
        self.gates: dict[str, threading.Event] = {}
        self.released_in_time: list[bool] = []
        self.running: dict[str, int] = {}
        self.most_running: dict[str, int] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        key = text[:1]
        with self.lock:
            self.running[key] = self.running.get(key, 0) + 1
            self.most_running[key] = max(self.most_running.get(key, 0), self.running[key])
        try:
            gate = self.gates.get(key)
            if gate is not None:
                self.released_in_time.append(gate.wait(GUARD_S))
            return self.real.encode(text, add_special_tokens=add_special_tokens)
        finally:
            with self.lock:
                self.running[key] -= 1


@pytest.fixture(scope="module")
def real_tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


def test_a_long_text_is_tokenized_while_the_loop_runs(real_tokenizer):
    tok = GatedTokenizer(real_tokenizer)
    tok.gates["x"] = threading.Event()
    pool = TokenizePool(tok)

    async def main():
        asyncio.get_running_loop().call_soon(tok.gates["x"].set)  # runs only if the loop does
        return await pool.encode(["x" * (INLINE_CHARS + 1)], False)

    try:
        (ids,) = asyncio.run(main())
    finally:
        pool.close()
    assert tok.released_in_time == [True]
    assert ids == real_tokenizer.encode("x" * (INLINE_CHARS + 1), add_special_tokens=False)


def test_a_slow_tokenization_does_not_hold_the_others(real_tokenizer):
    """Request A's encode is held until B's (submitted after it) has finished."""
    tok = GatedTokenizer(real_tokenizer)
    tok.gates["A"] = threading.Event()
    pool = TokenizePool(tok)

    async def main():
        a = asyncio.create_task(pool.encode(["A" * 5000], False))
        await asyncio.sleep(0)
        b = await pool.encode(["B" * 5000], False)
        tok.gates["A"].set()
        return await a, b

    try:
        a, b = asyncio.run(main())
    finally:
        pool.close()
    assert tok.released_in_time == [True] and len(a[0]) == len(b[0]) > 0


def test_a_batch_holds_one_worker_at_a_time(real_tokenizer):
    """A batch's texts go to the pool as jobs of at most JOB_CHARS, one job at a time, so
    a request behind it waits for one job, never for the whole batch."""
    tok = GatedTokenizer(real_tokenizer)
    pool = TokenizePool(tok)
    texts = ["A" * 40_000 for _ in range(12)]  # 480k characters: about 8 jobs
    try:
        out = asyncio.run(pool.encode(texts, False))
    finally:
        pool.close()
    assert len(out) == 12 and tok.most_running["A"] == 1


def test_detokenize_gives_the_tokenizers_decode(real_tokenizer):
    """Long id lists are decoded by the Rust decode that releases the GIL: same text."""
    pool = TokenizePool(real_tokenizer)
    ids = [i % 1990 + 3 for i in range(20_000)] + [0, 1, 2]  # special tokens kept
    try:
        text = asyncio.run(pool.decode(ids))
    finally:
        pool.close()
    assert text == real_tokenizer.decode(ids)


def test_text_bounds_name_the_limits(real_tokenizer):
    per = chars_per_token(real_tokenizer)
    assert per == max(len(t) for t in real_tokenizer.get_vocab())
    # the bound is sound: even the text made of the longest entries has no fewer tokens
    longest = max(real_tokenizer.get_vocab(), key=len)
    text = real_tokenizer.convert_tokens_to_string([longest]) * 50
    assert len(real_tokenizer.encode(text, add_special_tokens=False)) * per >= len(text)
    bounds = TextBounds(16, per, max_prompts=3, max_messages=2)
    bounds.check_text("a" * bounds.max_chars, "text")
    with pytest.raises(ApiError) as e:
        bounds.check_text("a" * (bounds.max_chars + 1), "prompt")
    assert e.value.status == 400 and e.value.param == "prompt"
    assert "16 tokens" in e.value.message
    with pytest.raises(ApiError, match="--max-batch-prompts"):
        bounds.check_count(4, "text")
    with pytest.raises(ApiError, match="--max-chat-messages"):
        bounds.check_messages(3)
