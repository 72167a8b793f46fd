"""Incremental detokenisation with stop strings.

``IncrementalDetokenizer`` turns a growing list of token ids into text without decoding
the whole list every step (the prefix/read offsets of vLLM's detokenizer), never emits
half a UTF-8 character, and holds back text that may be the start of a stop string, so
streamed pieces always concatenate to the final, stop-trimmed text. The server runs it
in its own process (issue: server); the offline Engine runs it in-process.
"""

from __future__ import annotations

from typing import Any

# tokens re-decoded before the new ones, so that merges across the boundary come out right
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 no_stop_trim: bool = False) -> None:
        self.tokenizer = tokenizer
        self.decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.decode_kwargs["spaces_between_special_tokens"] = False
        self.stop = stop or []
        self.no_stop_trim = no_stop_trim
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (complete characters only)
        self.emitted = 0  # characters of the final text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs)

    def add(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset: self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.read_offset = len(self.ids)
            self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)

    def final_text(self, matched_stop: Any = None) -> str:
        """The whole output text, trimmed at the matched stop string (unless no_stop_trim)."""
        text = self._decode(self.ids)
        if isinstance(matched_stop, str) and not self.no_stop_trim:
            cut = text.find(matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def delta(self) -> str:
        """New text that is safe to stream now (running request)."""
        safe = len(self.text) - self.holdback
        if safe <= self.emitted:
            return ""
        piece = self.text[self.emitted: safe]
        self.emitted = safe
        return piece

    def final_delta(self, matched_stop: Any = None) -> str:
        """The rest of the final text, when the request has finished."""
        text = self.final_text(matched_stop)
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece
