"""Tokenization in the server process: bounded, and off the event loop.

What one request can make the HTTP process do is bounded here: a text longer than the
context could ever hold is refused before it is tokenized (``TextBounds``), and every
encode, decode or chat-template rendering that can take more than about a millisecond runs
on one of a few worker threads (``TokenizePool``). Hugging Face's Rust ``encode`` and
``decode_batch`` release the GIL, so the loop keeps serving while they run; a jinja chat
template holds the GIL but yields it every ``sys.getswitchinterval()``.

Fairness: a request submits its work as jobs of at most ``JOB_CHARS`` characters, one at a
time, to a first-in first-out pool, so a batch of many texts waits its turn between jobs
and one request never holds every worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from radixlm.runtime.managers.api_error import ApiError

logger = logging.getLogger(__name__)

INLINE_CHARS = 256  # texts this short are tokenized on the loop (a few microseconds)
INLINE_IDS = 256  # id lists this short are decoded on the loop
JOB_CHARS = 1 << 16  # the texts of one request are tokenized in jobs of about this size
TOKENIZE_THREADS = 4

T = TypeVar("T")


def chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters of text that one token stands for: the longest
    vocabulary entry or added token as the tokenizer spells it (a byte-level entry spells
    each byte as one character, a SentencePiece one spells the space as one), or a
    WordPiece model's ``max_input_chars_per_word`` (a longer word becomes one unknown
    token). A text with more than ``context_length`` times this many characters has more
    tokens than the context holds."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    per_word = getattr(getattr(backend, "model", None), "max_input_chars_per_word", None)
    if isinstance(per_word, int):
        longest = max(longest, per_word)
    return max(longest, 1)


@dataclass(frozen=True)
class TextBounds:
    """How much text and how many items one request may bring."""

    context_len: int
    chars_per_token: int
    max_prompts: int  # --max-batch-prompts
    max_messages: int  # --max-chat-messages

    @property
    def max_chars(self) -> int:
        return self.context_len * self.chars_per_token

    def check_text(self, text: str, param: str) -> None:
        """400 if ``text`` has more characters than the context could hold as tokens."""
        if len(text) > self.max_chars:
            raise ApiError(
                400, f"{param} has {len(text)} characters, more than the "
                f"{self.max_chars} that fit this model's context of {self.context_len} "
                f"tokens (at most {self.chars_per_token} characters per token); shorten it",
                param=param)

    def check_count(self, count: int, param: str) -> None:
        """400 if a request holds more than ``--max-batch-prompts`` prompts."""
        if count > self.max_prompts:
            raise ApiError(400, f"{param} holds {count} prompts, over the server's limit of "
                           f"{self.max_prompts} (--max-batch-prompts)", param=param)

    def check_messages(self, count: int) -> None:
        if count > self.max_messages:
            raise ApiError(400, f"messages holds {count} messages, over the server's limit of "
                           f"{self.max_messages} (--max-chat-messages)", param="messages")


class TokenizePool:
    """The server process's tokenizer, used on worker threads for anything long."""

    def __init__(self, tokenizer: Any, threads: int = TOKENIZE_THREADS) -> None:
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token(tokenizer)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        # the Rust decode that releases the GIL, where it gives the wrapper's result
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_batch = (getattr(backend, "decode_batch", None)
                              if not getattr(tokenizer, "clean_up_tokenization_spaces", False)
                              else None)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text; short ones on the loop, the rest in jobs of about
        ``JOB_CHARS`` characters, one job at a time (see the module's fairness note)."""
        out: list[list[int]] = []
        i = 0
        while i < len(texts):
            j, size = i, 0
            while j < len(texts) and (j == i or size + len(texts[j]) <= JOB_CHARS):
                size += len(texts[j])
                j += 1
            group = texts[i:j]
            if size <= INLINE_CHARS:
                out += self._encode(group, add_special_tokens)
            else:
                out += await self._run(lambda g=group: self._encode(g, add_special_tokens))
            i = j
        return out

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    async def decode(self, ids: list[int]) -> str:
        """``tokenizer.decode(ids)``, off the loop unless ``ids`` is short."""
        if len(ids) <= INLINE_IDS:
            return self.tokenizer.decode(ids)
        return await self._run(lambda: self._decode(ids))

    def _decode(self, ids: list[int]) -> str:
        if self._decode_batch is not None:
            return self._decode_batch([ids], skip_special_tokens=False)[0]
        return self.tokenizer.decode(ids)

    async def render_chat(self, conversation: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to ``conversation`` (with the generation prompt),
        given ``tools`` (OpenAI's function tools) and the client's ``template_kwargs``
        (``chat_template_kwargs``, e.g. ``enable_thinking``); 400 if the template fails."""
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, **kwargs)

        try:
            if len(conversation) <= 2 and not tools and sum(
                    len(m.get("content") or "") for m in conversation) <= 256:
                return render()
            return await self._run(render)
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise ApiError(
                400, f"the chat template failed on these messages: {e}", param="messages"
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
