"""Incremental detokenisation with stop strings.

``IncrementalDetokenizer`` turns a growing list of token ids into text without decoding
the whole list every step (the prefix/read offsets of vLLM's detokenizer), never emits
half a UTF-8 character, and holds back text that may be the start of a stop string, so
streamed pieces always concatenate to the final, stop-trimmed text. The server runs it
in its own process (``run_detokenizer_process``); the offline Engine runs
``RequestDetokenizer`` in-process.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.child_setup import setup_child
from radixlm.runtime.managers.messages import (
    BatchOutput,
    DetokRegister,
    RegisterReqs,
    ReqOutput,
    TextBatch,
    TextOutput,
    decode,
    encode,
)
from radixlm.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# tokens re-decoded before the new ones, so that merges across the boundary come out right
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        no_stop_trim: bool = False,
    ) -> None:
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
        """Append tokens; text is decoded lazily (``delta``), so a request that is not
        streamed pays for one decode at the end."""
        self.ids.extend(token_ids)

    def _advance(self) -> None:
        """Decode the tokens past ``read_offset`` into ``self.text``, whole characters only."""
        if self.read_offset == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self.read_offset = len(self.ids)
            self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)

    def final_text(self, matched_stop: Any = None) -> str:
        """The whole output text, trimmed as SGLang's detokenizer trims it: a matched
        string (a stop string, or a stop_regex pattern found literally in the text) is cut
        off, or kept with what follows it dropped under no_stop_trim; a matched stop
        token id (stop_token_ids, EOS) is left out unless no_stop_trim."""
        ids = self.ids
        if (isinstance(matched_stop, int) and not isinstance(matched_stop, bool)
                and not self.no_stop_trim and ids and ids[-1] == matched_stop):
            ids = ids[:-1]
        text = self._decode(ids)
        if isinstance(matched_stop, str):
            cut = text.find(matched_stop)
            if cut >= 0:
                text = text[: cut + len(matched_stop)] if self.no_stop_trim else text[:cut]
        return text

    def delta(self) -> str:
        """New text that is safe to stream now (running request)."""
        self._advance()
        safe = len(self.text) - self.holdback
        if safe <= self.emitted:
            return ""
        piece = self.text[self.emitted : safe]
        self.emitted = safe
        return piece

    def final_delta(self, matched_stop: Any = None) -> str:
        """The rest of the final text, when the request has finished."""
        text = self.final_text(matched_stop)
        piece = text[self.emitted :]
        self.emitted = len(text)
        return piece


def make_register(rid: str, params: SamplingParams, text_in_logprobs: bool) -> DetokRegister:
    return DetokRegister(
        rid,
        params.skip_special_tokens,
        params.spaces_between_special_tokens,
        list(params.stop or []) or None,
        params.no_stop_trim,
        text_in_logprobs,
    )


class TokenTexts:
    """The text of single tokens (``decode([id])``, as logprob entries show it), decoded
    once per id: prompt logprobs with ``top_logprobs_num`` 64 over a 4k prompt name 266k
    tokens, which would otherwise be 266k decodes (0.7 s on the tiny model) holding every
    other request's output behind them. At most one entry per vocabulary id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, tok: int) -> str:
        text = self._texts.get(tok)
        if text is None:
            text = self._texts[tok] = self.tokenizer.decode([tok])
        return text


class RequestDetokenizer:
    """One request's ReqOutputs (token ids) -> TextOutputs (text pieces, logprob text)."""

    def __init__(self, tokenizer: Any, reg: DetokRegister,
                 token_texts: TokenTexts | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_text = token_texts or TokenTexts(tokenizer)
        self.text_in_logprobs = reg.text_in_logprobs
        self.detok = IncrementalDetokenizer(
            tokenizer,
            reg.skip_special_tokens,
            reg.spaces_between_special_tokens,
            reg.stop,
            reg.no_stop_trim,
        )

    def process(self, out: ReqOutput) -> TextOutput:
        self.detok.add(out.new_token_ids)
        final = None
        if out.finished:
            final = self.detok.final_text((out.finish_reason or {}).get("matched"))
            text = final[self.detok.emitted :]
            self.detok.emitted = len(final)
        else:
            text = self.detok.delta()
        res = TextOutput(
            out.rid,
            text,
            list(out.new_token_ids),
            out.prompt_tokens,
            out.cached_tokens,
            out.completion_tokens,
            out.finish_reason,
            final,
            embedding=out.embedding,
        )
        res.storage_cached_tokens = out.storage_cached_tokens
        res.spec = out.spec
        if out.output_token_logprobs is not None:
            res.output_token_logprobs = [self._entry(lp, t) for lp, t in out.output_token_logprobs]
        if out.output_top_logprobs is not None:
            res.output_top_logprobs = [self._top(t) for t in out.output_top_logprobs]
        if out.input_token_logprobs is not None:
            res.input_token_logprobs = [self._entry(lp, t) for lp, t in out.input_token_logprobs]
            res.input_top_logprobs = [self._top(t) for t in out.input_top_logprobs or []]
        if out.output_token_ids_logprobs is not None:
            res.output_token_ids_logprobs = [self._top(t) for t in out.output_token_ids_logprobs]
        if out.input_token_ids_logprobs is not None:
            res.input_token_ids_logprobs = [self._top(t) for t in out.input_token_ids_logprobs]
        return res

    def _entry(self, lp: float | None, tok: int) -> Any:
        return [lp, tok, self.token_text(tok) if self.text_in_logprobs else None]

    def _top(self, pairs: list | None) -> list | None:
        return None if pairs is None else [self._entry(lp, t) for lp, t in pairs]


class DetokenizerManager:
    """The detokenizer process's state: one RequestDetokenizer per live request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # shared by every request
        self.reqs: dict[str, RequestDetokenizer] = {}

    def handle(self, msg: Any) -> Any:
        """A message from the scheduler -> the message for the tokenizer manager (or None)."""
        if isinstance(msg, RegisterReqs):
            for reg in msg.reqs:
                self.reqs[reg.rid] = RequestDetokenizer(self.tokenizer, reg, self.token_texts)
            return None
        if isinstance(msg, BatchOutput):
            return TextBatch([self._process(out) for out in msg.outputs], msg.queue_times)
        return msg  # replies (server info, flush, ready) pass through

    def _process(self, out: ReqOutput) -> TextOutput:
        req = self.reqs.get(out.rid)
        if req is None:  # not registered (should not happen): default decode options
            req = self.reqs[out.rid] = RequestDetokenizer(self.tokenizer, DetokRegister(out.rid),
                                                          self.token_texts)
        try:
            res = req.process(out)
        except Exception as e:  # noqa: BLE001 - fail this request, keep serving the others
            logger.exception("detokenizing request %s failed", out.rid)
            self.reqs.pop(out.rid, None)
            reason = {"type": "abort", "message": f"detokenization failed: {e!r}",
                      "status_code": 500}
            return TextOutput(out.rid, "", [], out.prompt_tokens, out.cached_tokens,
                              out.completion_tokens, finish_reason=reason)
        if out.finished:
            del self.reqs[out.rid]
        return res


def run_detokenizer_process(
    tokenizer_path: str, in_addr: str, out_addr: str, parent_pid: int, log_level: str = "info"
) -> None:
    """Entry point of the detokenizer process: PULL from the scheduler, PUSH to the
    tokenizer manager, until SIGTERM or the parent's death."""
    should_stop = setup_child("detokenizer", parent_pid, log_level)
    manager = DetokenizerManager(load_tokenizer(tokenizer_path))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    try:
        while not should_stop():
            if not pull.poll(100):
                continue
            while True:
                try:
                    data = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = manager.handle(decode(data))
                if reply is not None:
                    push.send(encode(reply))
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
