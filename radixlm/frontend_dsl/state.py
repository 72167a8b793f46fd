"""What a program sees as ``s``: ``ProgramState``, and ``ProgramStateGroup`` for forks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.frontend_dsl.backends.base import merge_stream_meta
from radixlm.frontend_dsl.interpreter import StreamExecutor
from radixlm.frontend_dsl.ir import (
    ConcatenateAndAppend,
    Expr,
    ExprList,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)
from radixlm.frontend_dsl.tools import ToolCall

_DONE = object()


class ProgramState:
    """The state of one running program: ``s += expr``, ``s["var"]``, ``s.text()``, ..."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("Tried to append None to state.")
        self.stream_executor.submit(other)
        return self

    # --- roles: ``s.user("hi")`` appends a whole message; ``with s.user(): ...`` a block ---
    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            message = ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])
            self.stream_executor.submit(message)
            return message
        return self._role_block(role)

    @contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self.stream_executor.submit(RoleBegin(role))
        yield
        self.stream_executor.submit(RoleEnd(role))

    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.var_events or name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The backend's ``meta_info`` of the gen/select that set ``name`` (waits for it);
        None for a name no gen or select sets."""
        ex = self.stream_executor
        event = ex.var_events.get(name)
        if event is not None:
            ex.wait_for(event.is_set)
        return ex.meta_info.get(name)

    def tool_calls(self, name: str) -> list[ToolCall]:
        """The calls of the gen that set ``name`` (waits for it); [] when it made none."""
        self.stream_executor.get_var(name)
        return list(self.stream_executor.tool_calls_.get(name, []))

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        self.stream_executor.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        return self.stream_executor.error

    @property
    def arguments(self) -> dict[str, Any]:
        return self.stream_executor.arguments

    def fork(
        self, size: int = 1, position_ids_offset: list[int] | None = None
    ) -> ProgramStateGroup:
        """``size`` branches that share this state's text; its KV is cached first.
        ``position_ids_offset`` is accepted for SGLang's signature; as in SGLang 0.5's
        interpreter, it changes nothing."""
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        children = self.stream_executor.fork(size)  # waits for the parent's queue
        before = set(self.stream_executor.variables)
        return ProgramStateGroup([ProgramState(c) for c in children], self, before)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        """``with s.copy() as c: c += ...``: one branch, joined back when the block ends."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Text appended inside the block becomes variable ``name``."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Pieces of the text (or of one variable) as they are generated (``stream=True``);
        they concatenate to ``text()`` (or ``s[var_name]``)."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else str(self[var_name])
            return
        sent, seen = 0, -1
        while True:
            ex.wait_for(lambda s=seen: ex.version != s or self._done(var_name))
            with ex.cond:
                seen = ex.version
                done = self._done(var_name)
                source = ex.text_ if var_name is None else ex.variables.get(var_name, "")
                piece = str(source)[sent:]
            if piece:
                sent += len(piece)
                yield piece
            if done:
                ex.sync_all()
                return

    def _done(self, var_name: str | None) -> bool:
        ex = self.stream_executor
        if var_name is None or var_name not in ex.var_events:
            return ex.finished
        return ex.var_events[var_name].is_set()

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """``text_iter`` for asyncio: waits in a worker thread, never blocks the loop.
        With ``var_name`` and ``return_meta_data``, yields ``(piece, meta_info)``: the
        meta_info of the chunks that made the piece, their logprob lists joined."""
        if var_name is not None and return_meta_data:
            it: Iterator[Any] = self._chunks_with_meta(var_name)
        else:
            it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(None, next, it, _DONE)
            if piece is _DONE:
                return
            yield piece

    def _chunks_with_meta(self, var_name: str) -> Iterator[tuple[str, Any]]:
        ex = self.stream_executor
        if not ex.stream:
            value = self[var_name]
            yield value, ex.meta_info.get(var_name)
            return
        taken, seen = 0, -1
        pending: dict[str, Any] | None = None
        while True:
            ex.wait_for(lambda s=seen: ex.version != s or self._done(var_name))
            with ex.cond:
                seen = ex.version
                done = self._done(var_name)
                chunks = ex.stream_chunks.get(var_name, [])[taken:]
            taken += len(chunks)
            for piece, meta in chunks:
                pending = merge_stream_meta(pending, meta)
                if piece:
                    yield piece, pending
                    pending = None
            if done:
                if pending is not None:
                    yield "", pending  # a last chunk with no text (its finish_reason)
                ex.sync_all()
                return

    def __repr__(self) -> str:
        return f"ProgramState({self.stream_executor.text_!r})"


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: ``forks += lambda i: ...``, ``forks[i]``, ``join``."""

    def __init__(
        self, states: list[ProgramState], parent: ProgramState, vars_before_fork: set[str]
    ) -> None:
        self.states = states
        self.parent = parent
        self.vars_before_fork = vars_before_fork
        self.fork_text_len = len(parent.stream_executor.text_)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """``forks[i] += x`` stores ``forks[i]`` back; it must be the same branch."""
        if value is not self.states[i]:
            raise TypeError("a fork's branches cannot be replaced; use forks[i] += ...")

    def __iadd__(self, other: Any | Callable[[int], Any]) -> ProgramStateGroup:
        """``forks += expr`` (every branch), ``forks += lambda i: ...`` (per branch),
        ``forks += [x0, x1, ...]`` (one item per branch)."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(
                    f"forks += a list of {len(other)} items; the fork has {len(self.states)}"
                )
            items = list(other)
        elif callable(other) and not isinstance(other, Expr):
            items = [other(i) for i in range(len(self.states))]
        else:
            items = [other] * len(self.states)
        for state, item in zip(self.states, items):
            state += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and merge it into the parent: ``gather_variable`` sets
        each variable the branches made to the list of their values;
        ``concate_and_append`` appends what each branch wrote after the fork point."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join mode must be gather_variable or concate_and_append, got {mode!r}"
            )
        for state in self.states:
            state.stream_executor.sync_all()
        if mode == "gather_variable":
            names = {n for s in self.states for n in s.stream_executor.variables}
            for name in sorted(names - self.vars_before_fork):
                having = [
                    s.stream_executor for s in self.states if name in s.stream_executor.variables
                ]
                values = [ex.variables[name] for ex in having]
                metas = [ex.meta_info.get(name) for ex in having]
                self.parent.stream_executor.set_var(name, values, metas)
        else:
            texts = [s.stream_executor.text_[self.fork_text_len :] for s in self.states]
            self.parent += ConcatenateAndAppend(texts)
        for state in self.states:
            state.stream_executor.end()
        for state in self.states:
            state.stream_executor.join_threads()
