"""What a program sees as ``s``: ``ProgramState``, and ``ProgramStateGroup`` for forks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.frontend_dsl.interpreter import StreamExecutor
from radixlm.frontend_dsl.ir import ConcatenateAndAppend, VarScopeBegin, VarScopeEnd

_DONE = object()


class ProgramState:
    """The state of one running program: ``s += expr``, ``s["var"]``, ``s.text()``, ..."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(other)
        return self

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
        """The backend's ``meta_info`` of the gen/select that set ``name``."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.stream_executor.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        return self.stream_executor.error

    @property
    def arguments(self) -> dict[str, Any]:
        return self.stream_executor.arguments

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """``size`` branches that share this state's text; its KV is cached first."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        children = self.stream_executor.fork(size)  # waits for the parent's queue
        before = set(self.stream_executor.variables)
        return ProgramStateGroup([ProgramState(c) for c in children], self, before)

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

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """``text_iter`` for asyncio: waits in a worker thread, never blocks the loop."""
        it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(None, next, it, _DONE)
            if piece is _DONE:
                return
            yield piece

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

    def __iadd__(self, other: Any | Callable[[int], Any]) -> ProgramStateGroup:
        for i, state in enumerate(self.states):
            state += other(i) if callable(other) else other
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
                values = [s.stream_executor.variables.get(name) for s in self.states]
                metas = [s.stream_executor.meta_info.get(name) for s in self.states]
                self.parent.stream_executor.set_var(name, values, metas)
        else:
            texts = [s.stream_executor.text_[self.fork_text_len :] for s in self.states]
            self.parent += ConcatenateAndAppend(texts)
        for state in self.states:
            state.stream_executor.end()
        for state in self.states:
            state.stream_executor.join_threads()
