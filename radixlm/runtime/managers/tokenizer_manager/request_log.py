"""The request log: one JSON record per finished request.

``--log-requests`` (SGLang's flag) writes each record to the console through this module's
logger, with as much as ``--log-requests-level`` allows (SGLang's levels: 0 metadata, 1 and
sampling params, 2 and the prompt up to 2048 characters, 3 and the prompt up to
``--log-requests-max-chars``). ``--log-requests-file FILE`` appends every record, prompt
included, as one line of JSONL: the input of ``radixlm prefix-report``.

A record::

    {"time": 1714000000.12, "rid": "...", "route": "/v1/chat/completions", "stream": false,
     "messages": [{"role": "user", "content": "..."}]   (or "text": "...", or "input_ids"),
     "namespace": "default" | "salted" | "tenant:NAME", "tenant": NAME or null,
     "prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": 8,
     "finish_reason": {...}, "latency": {"ttft": s, "tpot": s, "e2e": s},
     "sampling_params": {...}}

The namespace is ``validation.namespace_label``: never an ``extra_key`` or ``cache_salt``.
A prompt longer than the limit is cut, ``TRUNCATION_MARK`` is appended to its text (to the
last kept message's content for chats) and the record gets ``"truncated": true``; token ids
are cut without a mark. Records are queued to a writer thread, so the event loop never
waits on the disk; past ``MAX_PENDING`` unwritten records, new ones are dropped and counted.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.managers.messages import GenerateReqInput, TextOutput
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import client_rid
from radixlm.runtime.managers.validation import namespace_label

logger = logging.getLogger(__name__)

TRUNCATION_MARK = "...[truncated {n} chars]"  # appended to a cut prompt text
CONSOLE_LEVEL2_CHARS = 2048  # SGLang's limit at --log-requests-level 2
MAX_PENDING = 10_000


@dataclass(frozen=True)
class RequestOrigin:
    """What the HTTP layer knows of a request that the scheduler's messages do not."""

    route: str
    prompt: str | list[dict[str, str]] | None = None  # text, chat messages, or None: ids
    tenant: str | None = None
    stream: bool = False


@dataclass(frozen=True)
class Timings:
    """Monotonic times of one request: sent, first token, finished."""

    created: float
    first_token: float | None
    finished: float
    completion_tokens: int

    def latency(self) -> dict[str, float | None]:
        ttft = None if self.first_token is None else self.first_token - self.created
        tpot = None
        if self.first_token is not None and self.completion_tokens > 1:
            tpot = (self.finished - self.first_token) / (self.completion_tokens - 1)
        return {"ttft": _round(ttft), "tpot": _round(tpot),
                "e2e": _round(self.finished - self.created)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def cut_text(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit] + TRUNCATION_MARK.format(n=len(text) - limit), True


def cut_messages(messages: list[dict[str, str]], limit: int
                 ) -> tuple[list[dict[str, str]], bool]:
    """The messages while their contents fit in ``limit`` characters in all; the message
    that crosses it is cut and marked, later ones are dropped (their characters counted)."""
    out: list[dict[str, str]] = []
    left = limit
    for i, m in enumerate(messages):
        content = m.get("content", "")
        if len(content) <= left:
            out.append(m)
            left -= len(content)
            continue
        rest = len(content) - left + sum(len(x.get("content", "")) for x in messages[i + 1:])
        out.append({**m, "content": content[:left] + TRUNCATION_MARK.format(n=rest)})
        return out, True
    return out, False


def prompt_fields(origin: RequestOrigin, input_ids: list[int], limit: int) -> dict[str, Any]:
    """``text``, ``messages`` or ``input_ids``, at most ``limit`` characters (or ids)."""
    if isinstance(origin.prompt, str):
        text, cut = cut_text(origin.prompt, limit)
        return {"text": text, "truncated": cut}
    if isinstance(origin.prompt, list):
        messages, cut = cut_messages(origin.prompt, limit)
        return {"messages": messages, "truncated": cut}
    return {"input_ids": list(input_ids[:limit]), "truncated": len(input_ids) > limit}


def build_record(msg: GenerateReqInput, origin: RequestOrigin, out: TextOutput,
                 timings: Timings, max_chars: int) -> dict[str, Any]:
    """The full record (the file's); ``console_view`` trims it for the console."""
    return {
        "time": round(time.time(), 6),
        "rid": client_rid(msg.rid),  # a tenant's, as its client sent it
        "route": origin.route,
        "stream": origin.stream,
        **prompt_fields(origin, msg.input_ids, max_chars),
        "namespace": namespace_label(msg.namespace),
        "tenant": origin.tenant,
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.cached_tokens,
        "completion_tokens": out.completion_tokens,
        "finish_reason": out.finish_reason,
        "latency": timings.latency(),
        "sampling_params": msg.sampling_params,
    }


def console_view(record: dict[str, Any], level: int, max_chars: int) -> dict[str, Any]:
    """``record`` as SGLang's ``--log-requests-level`` shows it."""
    prompt_keys = ("text", "messages", "input_ids", "truncated")
    view = {k: v for k, v in record.items() if k not in prompt_keys}
    if level == 0:
        view.pop("sampling_params")
    if level >= 2:
        origin = RequestOrigin("", record.get("text", record.get("messages")))
        limit = CONSOLE_LEVEL2_CHARS if level == 2 else max_chars
        view.update(prompt_fields(origin, record.get("input_ids", []), limit))
        view["truncated"] = view["truncated"] or record["truncated"]
    return view


class RequestLog:
    """Writes records to the console and/or a JSONL file from a daemon thread."""

    def __init__(self, path: str | None, console_level: int | None, max_chars: int) -> None:
        self.path, self.console_level, self.max_chars = path, console_level, max_chars
        self.dropped = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(MAX_PENDING)
        self._file: IO[str] | None = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: ServerArgs) -> RequestLog | None:
        if not (args.log_requests or args.log_requests_file):
            return None
        level = args.log_requests_level if args.log_requests else None
        return cls(args.log_requests_file, level, args.log_requests_max_chars)

    def add(self, msg: GenerateReqInput, origin: RequestOrigin, out: TextOutput,
            timings: Timings) -> None:
        """Queue the record of a finished request; never blocks."""
        try:
            self._queue.put_nowait(build_record(msg, origin, out, timings, self.max_chars))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("request log: %d records dropped (the writer is behind)",
                               self.dropped)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for record in batch:
                if record is not None:
                    self._write(record)
            if self._file is not None:
                self._file.flush()
            if batch[-1] is None:
                return

    def _write(self, record: dict[str, Any]) -> None:
        try:
            if self._file is not None:
                self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            if self.console_level is not None:
                view = console_view(record, self.console_level, self.max_chars)
                logger.info("request %s", json.dumps(view, ensure_ascii=False))
        except (OSError, TypeError, ValueError) as e:  # a full disk must not stop serving
            logger.warning("request log: cannot write the record of %s: %s", record["rid"], e)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._file is not None:
            self._file.close()
