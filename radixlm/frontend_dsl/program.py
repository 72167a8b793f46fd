"""``@function`` programs: ``run``, ``run_batch``, ``bind``, and the default backend."""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from radixlm.frontend_dsl.backends import Backend, Prompt, as_backend
from radixlm.frontend_dsl.interpreter import StreamExecutor
from radixlm.frontend_dsl.ir import SamplingArgs
from radixlm.frontend_dsl.state import ProgramState
from radixlm.frontend_dsl.tracer import extract_prefix

_default_backend: list[Backend | None] = [None]


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when ``run(backend=...)`` is not given."""
    _default_backend[0] = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend[0]


def resolve_backend(backend: Any | None) -> Backend:
    if backend is None:
        backend = _default_backend[0]
        if backend is None:
            raise RuntimeError(
                "no backend: call sgl.set_default_backend(...) or pass backend=... to run()"
            )
    return as_backend(backend)


class ProgramBatchError(RuntimeError):
    """Some programs of a ``run_batch`` failed; ``states`` holds all of them."""

    def __init__(self, message: str, states: list[ProgramState]) -> None:
        super().__init__(message)
        self.states = states


def _sampling_defaults(
    max_new_tokens: int = 128,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    ignore_eos: bool = False,
    return_logprob: bool = False,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> SamplingArgs:
    return SamplingArgs(
        max_new_tokens=max_new_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob or None,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )


_SAMPLING_KEYS = set(inspect.signature(_sampling_defaults).parameters)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[SamplingArgs, dict[str, Any]]:
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_KEYS}
    return _sampling_defaults(**sampling), kwargs


class SglFunction:
    """A DSL program: ``@sgl.function def prog(s, arg): ...``."""

    def __init__(
        self,
        func: Callable[..., Any],
        bind_arguments: dict[str, Any] | None = None,
        num_api_spec_tokens: int | None = None,
    ) -> None:
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        self.num_api_spec_tokens = num_api_spec_tokens
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(
                f"{func.__name__} must take the program state as its first "
                "argument: def {func.__name__}(s, ...)"
            )
        self.arg_names = params[1:]

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs}, self.num_api_spec_tokens)

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Any = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once. Sampling keywords (``max_new_tokens``, ``temperature``, ``stop``, ...)
        are the defaults of every ``gen``; other keywords are the program's arguments.
        Without ``stream`` it returns when the program is done and raises its error;
        with ``stream=True`` it returns at once (read with ``text_iter``)."""
        defaults, func_kwargs = _split_kwargs(kwargs)
        state = self._start(resolve_backend(backend), args, func_kwargs, defaults, stream, timeout)
        if not stream and state.error() is not None:
            raise state.error()
        return state

    __call__ = run

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        timeout: float | None = None,
        raise_errors: bool = True,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run once per dict of arguments on a thread pool, after caching the program's
        constant prefix once. A failed program raises ``ProgramBatchError`` (with every
        state) once all are done, or, with ``raise_errors=False``, stays in its state."""
        defaults, extra = _split_kwargs(dict(sampling))
        if extra:
            raise TypeError(f"unknown run_batch argument(s) {sorted(extra)}")
        if not all(isinstance(kw, dict) for kw in batch_kwargs):
            raise TypeError("run_batch takes a list of dicts of program arguments")
        be = resolve_backend(backend)
        if len(batch_kwargs) > 1:
            self.cache(be)
        if num_threads == "auto":
            num_threads = max(64, (os.cpu_count() or 1) * 16)
        workers = max(1, min(int(num_threads), len(batch_kwargs) or 1))
        with (
            tqdm(total=len(batch_kwargs), disable=not progress_bar, desc=self.func.__name__) as bar,
            ThreadPoolExecutor(workers) as pool,
        ):

            def one(kw: dict[str, Any]) -> ProgramState:
                try:
                    return self._start(be, (), dict(kw), defaults, False, timeout)
                finally:
                    bar.update(1)

            states = list(pool.map(one, batch_kwargs))
        failed = [s for s in states if s.error() is not None]
        if failed and raise_errors:
            raise ProgramBatchError(
                f"{len(failed)} of {len(states)} programs failed; first "
                f"error: {failed[0].error()!r}",
                states,
            ) from failed[0].error()
        return states

    def trace(self, backend: Any = None, **kwargs: Any) -> str:
        """The constant text every run of this program starts with."""
        template = resolve_backend(backend).get_chat_template()
        return extract_prefix(self.func, {**self.bind_arguments, **kwargs}, template)

    def cache(self, backend: Any = None) -> str:
        """Cache the program's constant prefix in the backend; returns the prefix."""
        be = resolve_backend(backend)
        prefix = self.trace(be)
        if prefix:
            be.cache_prefix(Prompt(prefix))
        return prefix

    def _start(
        self,
        backend: Backend,
        args: tuple,
        kwargs: dict[str, Any],
        defaults: SamplingArgs,
        stream: bool,
        timeout: float | None,
    ) -> ProgramState:
        kwargs = {**self.bind_arguments, **kwargs}
        deadline = None if timeout is None else time.monotonic() + timeout
        executor = StreamExecutor(
            backend, kwargs, defaults, backend.get_chat_template(), stream, deadline
        )
        state = ProgramState(executor)
        if stream:
            threading.Thread(
                target=_run_body,
                args=(state, self.func, args, kwargs),
                daemon=True,
                name="radixlm-dsl-program",
            ).start()
            return state
        _run_body(state, self.func, args, kwargs)
        try:
            executor.sync_all()
        except BaseException:  # noqa: BLE001 - it is on the state; run() raises it
            pass
        executor.join_threads()
        return state


def _run_body(
    state: ProgramState, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> None:
    executor = state.stream_executor
    try:
        state.ret_value = func(state, *args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - kept on the state, raised by run()
        executor.cancel(e)
    finally:
        executor.end()


def function(
    func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None
) -> Any:
    """Decorator: ``@sgl.function`` (or ``@sgl.function(num_api_spec_tokens=...)``)."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
