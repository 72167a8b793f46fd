"""ResultBuilder: one request's TextOutputs -> SGLang-shaped ``/generate`` dicts.

Used by the offline Engine (after an in-process RequestDetokenizer) and by the server's
tokenizer manager (after the detokenizer process), so both return the same shapes.

Logprob entries are kept as they arrive (never copied entry by entry): prompt logprobs
with ``top_logprobs_num`` 64 over a 4k prompt are 266k entries, about 45 MB of Python
objects per request. A server stream sends them with the chunk that brings them and with
the final chunk, each time as the same JSON encoded once (``msgspec.Raw``), and ``null``
in the chunks between: resending them with every chunk (as SGLang does) made a stream
cost chunks x 9 MB of JSON, each encoded on the event loop (0.2 s apiece).
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixlm.runtime.managers.messages import SpecCounts, TextOutput

PROMPT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def spec_meta(spec: SpecCounts, completion_tokens: int) -> dict[str, Any]:
    """SGLang's speculative ``meta_info``: decode forwards (``spec_verify_ct``), output
    tokens per forward (``spec_accept_length``: completion tokens / forwards, the first
    token, from the prefill, included as SGLang counts it) and the drafts' acceptance."""
    return {"spec_verify_ct": spec.verify_ct,
            "spec_accept_length": (completion_tokens / spec.verify_ct
                                   if spec.verify_ct else 0.0),
            "spec_accept_rate": (spec.accepted_tokens / spec.draft_tokens
                                 if spec.draft_tokens else 0.0),
            "spec_accept_token_num": spec.accepted_tokens,
            "spec_draft_token_num": spec.draft_tokens}


class ResultBuilder:
    """Accumulates text, ids and logprob entries ``[logprob, token_id, text|None]``."""

    def __init__(self, rid: str, return_logprob: bool, top_logprobs_num: int,
                 token_ids_logprob: bool = False) -> None:
        self.rid = rid
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        # SGLang's token_ids_logprob: shaped as the top logprobs, one list per position
        self.token_ids_logprob = token_ids_logprob and return_logprob
        self.output_ids_lps: list = []
        self.new_ids_lps: list = []
        self.input_ids_lps: list | None = None
        self.last: TextOutput | None = None
        self.text = ""
        self.output_ids: list[int] = []
        self.output_lps: list = []
        self.output_top: list = []
        self.input_lps: list | None = None
        self.input_top: list | None = None
        self.new_lps: list = []
        self.new_top: list = []
        self.weight_version: str | None = None  # set by the owner (SGLang's meta_info field)
        self._prompt_fresh = False  # the latest output brought the prompt logprobs
        self._prompt_json: dict[str, msgspec.Raw] | None = None  # encoded once, for streams

    def add(self, out: TextOutput) -> None:
        self.last = out
        self.text = out.final_text if out.final_text is not None else self.text + out.text
        self.output_ids += out.new_token_ids
        self.new_lps = out.output_token_logprobs or []
        self.new_top = out.output_top_logprobs or []
        self.output_lps += self.new_lps
        self.output_top += self.new_top
        self._prompt_fresh = False
        if out.input_token_logprobs is not None:
            self.input_lps = out.input_token_logprobs
            self.input_top = out.input_top_logprobs or []
            self._prompt_fresh, self._prompt_json = True, None
        self.new_ids_lps = out.output_token_ids_logprobs or []
        self.output_ids_lps += self.new_ids_lps
        if out.input_token_ids_logprobs is not None:
            self.input_ids_lps = out.input_token_ids_logprobs
            self._prompt_fresh, self._prompt_json = True, None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def meta(self, latency: float, incremental: bool) -> dict[str, Any]:
        out = self.last
        assert out is not None, f"no output yet for {self.rid}"
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
            "e2e_latency": latency,
        }
        if out.storage_cached_tokens is not None:  # --enable-hierarchical-cache
            meta["cached_tokens_details"] = {
                "device": out.cached_tokens - out.storage_cached_tokens,
                "storage": out.storage_cached_tokens}
        if out.spec is not None:  # --speculative-algorithm: SGLang's fields
            meta.update(spec_meta(out.spec, out.completion_tokens))
        if self.weight_version is not None:
            meta["weight_version"] = self.weight_version
        if self.return_logprob:
            meta["output_token_logprobs"] = self.new_lps if incremental else self.output_lps
            meta["output_token_logprobs_length"] = len(self.output_lps)
            if self.top_logprobs_num:
                meta["output_top_logprobs"] = self.new_top if incremental else self.output_top
            meta["input_token_logprobs"] = self.input_lps
            if self.top_logprobs_num:
                meta["input_top_logprobs"] = self.input_top
            if self.token_ids_logprob:
                meta["input_token_ids_logprobs"] = self.input_ids_lps
                meta["output_token_ids_logprobs"] = (
                    self.new_ids_lps if incremental else self.output_ids_lps)
        return meta

    def to_dict(self, latency: float) -> dict[str, Any]:
        return {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self.meta(latency, incremental=False),
        }

    def chunk(self, latency: float, cumulative: bool = False) -> dict[str, Any]:
        """A streaming chunk: the new text and ids (Engine), or everything so far
        (``cumulative``, the server's SSE chunks, as SGLang sends them)."""
        out = self.last
        assert out is not None, f"no output yet for {self.rid}"
        if cumulative:
            meta = self.meta(latency, incremental=True)
            if self.return_logprob:
                self._stream_prompt_logprobs(meta)
            return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        return {
            "text": out.text,
            "output_ids": list(out.new_token_ids),
            "meta_info": self.meta(latency, incremental=True),
        }

    def _stream_prompt_logprobs(self, meta: dict[str, Any]) -> None:
        """A stream chunk's prompt logprobs: the encoded JSON in the chunk that brought
        them and in the final chunk, ``null`` in the chunks between (module docstring)."""
        keys = [k for k in PROMPT_KEYS if k in meta]
        if not (self._prompt_fresh or self.finished):
            meta.update(dict.fromkeys(keys))
            return
        if self._prompt_json is None:
            self._prompt_json = {k: msgspec.Raw(msgspec.json.encode(meta[k])) for k in keys}
        meta.update(self._prompt_json)
