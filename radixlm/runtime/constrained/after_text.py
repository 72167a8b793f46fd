"""A grammar that starts after a marker in the output: a reasoning model thinks freely,
and only its answer, after ``</think>``, is held to the request's grammar.

    matcher = AfterTextMatcher(grammar.new_matcher(), "</think>", tokenizer)

Until the decoded output contains the marker every token is allowed (the mask row is left
as allocated: all ones) and nothing is forced; the token that completes the marker is the
last free one. (vLLM and SGLang hold back structured output the same way while a
reasoning parser says the model is thinking.) Rollback may cross back over the marker.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm.runtime.constrained.base import Matcher

# tokens of output decoded to look for the marker: enough for any tokenization of it
_WINDOW = 32


class AfterTextMatcher(Matcher):
    def __init__(self, inner: Matcher, marker: str, tokenizer: Any) -> None:
        self.inner, self.marker, self.tokenizer = inner, marker, tokenizer
        self.free: list[int] = []  # tokens accepted before the grammar started
        self.held = 0  # tokens the inner matcher accepted
        self.started = False

    def _marker_done(self) -> bool:
        tail = self.tokenizer.decode(self.free[-_WINDOW:], skip_special_tokens=False)
        return self.marker in tail

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.started:
            ok = self.inner.accept_token(token_id)
            self.held += ok
            return ok
        self.free.append(token_id)
        self.started = self._marker_done()
        return True

    def rollback(self, num_tokens: int) -> None:
        inner = min(num_tokens, self.held)
        self.inner.rollback(inner)
        self.held -= inner
        rest = num_tokens - inner
        if rest:
            assert rest <= len(self.free), (num_tokens, self.held, len(self.free))
            del self.free[len(self.free) - rest:]
            self.started = bool(self.free) and self._marker_done()

    def is_terminated(self) -> bool:
        return self.started and self.inner.is_terminated()

    def is_accepting(self) -> bool:
        return self.started and self.inner.is_accepting()

    def forced_string(self) -> str:
        return self.inner.forced_string() if self.started else ""

    def error(self) -> str:
        return self.inner.error() if self.started and hasattr(self.inner, "error") else ""
