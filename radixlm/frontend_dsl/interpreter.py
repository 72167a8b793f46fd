"""Runs a program's expressions on a backend.

Each program state owns a ``StreamExecutor``: ``s += expr`` queues the expression and
returns at once; a worker thread executes the queue in order (so the branches of a fork
run concurrently), and reads such as ``s["var"]`` or ``s.text()`` wait for it. The first
error stops the executor: later expressions are skipped, every waiter wakes, and the
error is raised to whoever reads the state. A deadline (``run(timeout=...)``) turns into
``TimeoutError`` and aborts the request in flight.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from radixlm.frontend_dsl.backends.base import Backend, Prompt, merge_stream_meta
from radixlm.frontend_dsl.chat_template import ChatTemplate
from radixlm.frontend_dsl.ir import (
    CommitLazy,
    ConcatenateAndAppend,
    ConstantText,
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    SamplingArgs,
    Select,
    SeparateReasoning,
    ToolResult,
    Variable,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
)
from radixlm.frontend_dsl.reasoning import split_reasoning
from radixlm.frontend_dsl.tool_turns import ToolTurns

_END = object()
_ids = itertools.count()
_NUMBER_STOPS = (" ", "\n")  # SGLang ends int/float gens at the first space or newline
_LOGPROB_ARGS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)


class StreamExecutor(ToolTurns):
    """The text, messages and variables of one program state, built by a worker thread."""

    def __init__(
        self,
        backend: Backend,
        arguments: dict[str, Any],
        default_args: SamplingArgs,
        chat_template: ChatTemplate,
        stream: bool,
        deadline: float | None,
        use_thread: bool = True,
    ) -> None:
        self.backend = backend
        self.arguments = arguments
        self.default_args = default_args
        self.chat_template = chat_template
        self.stream = stream
        self.deadline = deadline
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.stream_chunks: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.var_events: dict[str, threading.Event] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.scope_begin: dict[str, int] = {}
        self.error: BaseException | None = None
        self.children: list[StreamExecutor] = []
        self.cond = threading.Condition()
        self.pending = 0
        self.version = 0  # bumped on every text change; streaming readers wait on it
        self.ended = False
        self.finished = False
        self.inflight_rid: str | None = None
        self.init_tool_state()
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        if use_thread:
            self.thread = threading.Thread(
                target=self._worker, daemon=True, name=f"radixlm-dsl-{next(_ids)}"
            )
            self.thread.start()

    # --- submitting and waiting ---------------------------------------------------------
    def submit(self, value: Any) -> None:
        exprs = flatten(value)
        with self.cond:
            if self.error is not None:
                raise self.error
            if self.ended:
                raise RuntimeError("the program has ended; its state takes no more expressions")
            for e in exprs:
                named = (Gen, Select, VarScopeEnd, SeparateReasoning)
                name = e.name if isinstance(e, named) else None
                if name is not None:
                    self.var_events.setdefault(name, threading.Event()).clear()
            if self.thread is not None:
                self.pending += len(exprs)
        for e in exprs:
            if self.thread is None:
                self._execute(e)  # run(use_thread=False), tracing: errors reach the caller
            else:
                self.queue.put(e)

    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            if expr is _END:
                break
            if self.error is None:
                try:
                    self._execute(expr)
                except BaseException as e:  # noqa: BLE001 - kept and raised to readers
                    self.fail(e)
            with self.cond:
                self.pending -= 1
                self.cond.notify_all()
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait (until the deadline) for ``predicate``; raise the executor's error. The
        deadline is checked even when ``predicate`` already holds: a stream reader that
        finds new text at every call must still see the program time out."""
        timed_out = False
        with self.cond:
            while self.error is None:
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is not None and left <= 0 and not self.finished:
                    timed_out = True
                    break
                if predicate():
                    break
                self.cond.wait(left)
        if timed_out:
            self.cancel(TimeoutError("the program did not finish before its timeout"))
        if self.error is not None:
            raise self.error

    def sync(self) -> None:
        self.wait_for(lambda: self.pending == 0)

    def sync_all(self) -> None:
        """Wait for this executor and every fork under it; raise the first error."""
        self.sync()
        for child in list(self.children):
            child.sync_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            for event in self.var_events.values():
                event.set()
            self.cond.notify_all()

    def cancel(self, error: BaseException) -> None:
        """Stop this executor and its forks with ``error``; abort requests in flight."""
        self.fail(error)
        rid = self.inflight_rid
        if rid is not None:
            self.backend.abort(rid)
        for child in list(self.children):
            child.cancel(error)

    def end(self) -> None:
        with self.cond:
            if self.ended:
                return
            self.ended = True
        if self.thread is not None:
            self.queue.put(_END)
        else:
            self.finished = True
        for child in list(self.children):
            child.end()

    def join_threads(self, timeout: float = 30.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
        for child in list(self.children):
            child.join_threads(timeout)

    # --- variables ------------------------------------------------------------------------
    def get_var(self, name: str) -> Any:
        event = self.var_events.get(name)
        if event is None:
            self.sync()
            with self.cond:
                if name not in self.variables:
                    raise KeyError(
                        f"no variable {name!r} in this program; variables: {sorted(self.variables)}"
                    )
                return self.variables[name]
        self.wait_for(event.is_set)
        return self.variables[name]

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            self.var_events.setdefault(name, threading.Event()).set()
            self.cond.notify_all()

    def fork(self, size: int) -> list[StreamExecutor]:
        """``size`` copies of this state after caching its text once in the runtime."""
        self.submit(CommitLazy())
        self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend,
                self.arguments,
                self.default_args,
                self.chat_template,
                self.stream,
                self.deadline,
            )
            with self.cond:
                child.text_, child.messages_ = self.text_, list(self.messages_)
                child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
                child.cur_role, child.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
                child.scope_begin = dict(self.scope_begin)
                child.copy_tool_state(self)
                for name in self.variables:
                    child.var_events.setdefault(name, threading.Event()).set()
                self.children.append(child)
            children.append(child)
        return children

    # --- execution (worker thread) ----------------------------------------------------------
    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ConstantText):
            self._append(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.scope_begin[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.set_var(expr.name, self.text_[self.scope_begin.pop(expr.name, 0) :])
        elif isinstance(expr, Variable):
            self._append(str(self.variables[expr.name]))
        elif isinstance(expr, CommitLazy):
            self.backend.cache_prefix(self.prompt())
        elif isinstance(expr, ConcatenateAndAppend):
            self._append("".join(expr.texts))
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        elif isinstance(expr, ToolResult):
            self.tool_result(expr)
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}")

    def _append(self, text: str) -> None:
        with self.cond:
            self.text_ += text
            self.version += 1
            self.cond.notify_all()

    def prompt(self) -> Prompt:
        left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        open_text = self.text_[self.cur_role_begin_pos :] if self.cur_role else ""
        return Prompt(self.text_, list(self.messages_), self.cur_role, open_text, timeout=left)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"{role}() begins inside {self.cur_role}(); end that role first")
        tpl = self.chat_template
        if not self.text_ and not self.messages_:
            self._append(tpl.preamble)
            if role != "system" and tpl.default_system_prompt:
                self._role_begin("system")
                self._append(tpl.default_system_prompt)
                self._role_end("system")
        self._append(tpl.prefix(role))
        self.cur_role, self.cur_role_begin_pos = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(
                f"{role}_end() without a matching {role}_begin() (open role: {self.cur_role})"
            )
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        self.end_message({"role": role, "content": content}, self.chat_template.suffix(role))
        self.cur_role = None

    def _gen(self, expr: Gen) -> None:
        args = expr.args.merged_over(self.default_args)
        if args.n not in (None, 1):
            raise ValueError(f"gen() takes n=1 (got n={args.n}); use s.fork(n) for samples")
        params = args.to_sampling_params()
        extra_stops = list(self.chat_template.stop_str)  # as SGLang: every gen, any role
        if expr.dtype in ("int", "float"):
            extra_stops += _NUMBER_STOPS
        if extra_stops:
            stop = params.get("stop") or []
            stop = [stop] if isinstance(stop, str) else list(stop)
            params["stop"] = stop + [s for s in extra_stops if s not in stop]
        logprob_args = {k: getattr(args, k) for k in _LOGPROB_ARGS if getattr(args, k) is not None}
        if self.is_tool_gen(expr):
            self.tool_gen(expr, params, logprob_args)  # one request, not streamed
            return
        prompt = self.prompt()
        self.inflight_rid = prompt.rid
        try:
            text, meta = self._run_gen(expr.name, prompt, params, logprob_args)
        finally:
            self.inflight_rid = None
        if self.error is not None:  # cancelled while the request ran
            raise self.error
        if expr.name is not None:
            self.set_var(expr.name, text, meta)

    def _run_gen(
        self, name: str | None, prompt: Prompt, params: dict[str, Any], logprob_args: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        if not self.stream:
            text, meta = self.backend.generate(prompt, params, logprob_args)
            self._append(text)
            return text, meta
        pieces: list[str] = []
        meta: dict[str, Any] = {}
        if name is not None:
            with self.cond:
                self.stream_chunks[name] = []
        chunks = self.backend.generate_stream(prompt, params, logprob_args)
        try:
            for piece, chunk_meta in chunks:
                if self.error is not None:
                    break
                meta = merge_stream_meta(meta, chunk_meta)
                pieces.append(piece)
                with self.cond:
                    if name is not None:
                        self.variables[name] = "".join(pieces)
                        self.meta_info[name] = chunk_meta
                        self.stream_chunks.setdefault(name, []).append((piece, chunk_meta))
                    self.text_ += piece
                    self.version += 1
                    self.cond.notify_all()
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a generator left early aborts its request
        return "".join(pieces), meta

    def _select(self, expr: Select) -> None:
        decision = self.backend.select(
            self.prompt(), expr.choices, expr.temperature, expr.choices_method
        )
        self._append(decision.decision)
        if expr.name is not None:
            self.set_var(expr.name, decision.decision, decision.meta_info)

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        """Keep the answer in the source variable and the text; the reasoning in its own
        variable. The source's text is the end of the program's text when this runs."""
        text = str(self.variables[expr.source])
        reasoning, answer = split_reasoning(text, expr.model_type)
        with self.cond:
            if self.text_.endswith(text):
                self.text_ = self.text_[: len(self.text_) - len(text)] + answer
                self.version += 1
        self.set_var(expr.source, answer)
        self.set_var(expr.name, reasoning)
