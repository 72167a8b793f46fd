"""``@function`` programs: ``run``, ``run_batch``, ``bind``, and the default backend."""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from radixlm.frontend_dsl.backends import Backend, Prompt, as_backend
from radixlm.frontend_dsl.global_config import global_config
from radixlm.frontend_dsl.interpreter import StreamExecutor
from radixlm.frontend_dsl.ir import SamplingArgs
from radixlm.frontend_dsl.state import ProgramState
from radixlm.frontend_dsl.tracer import extract_prefix


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when ``run(backend=...)`` is not given (None: none)."""
    global_config.default_backend = None if backend is None else as_backend(backend)


def get_default_backend() -> Backend | None:
    backend = global_config.default_backend
    return None if backend is None else as_backend(backend)


def resolve_backend(backend: Any | None) -> Backend:
    if backend is None:
        backend = global_config.default_backend
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
    n: int = 1,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    ignore_eos: bool = False,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> SamplingArgs:
    """The defaults of every ``gen`` of a run: SGLang's ``run``/``run_batch`` sampling
    keywords, with its defaults."""
    return SamplingArgs(
        max_new_tokens=max_new_tokens,
        n=n,
        stop=stop,
        stop_token_ids=stop_token_ids,
        stop_regex=stop_regex,
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


_SAMPLING_KEYS = tuple(inspect.signature(_sampling_defaults).parameters)


class SglFunction:
    """A DSL program: ``@sgl.function def prog(s, arg): ...``."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(
                f"{func.__name__} must take the program state as its first "
                f"argument: def {func.__name__}(s, ...)"
            )
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not p.empty]

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once (SGLang's keywords). The sampling keywords are the defaults of every
        ``gen``; other keywords are the program's arguments. Without ``stream`` it returns
        when the program is done and raises its error; with ``stream=True`` it returns at
        once (read with ``text_iter``). ``use_thread=False`` runs the program's calls in
        the caller's thread; ``timeout`` (radixlm's) bounds the whole run in seconds."""
        defaults = _defaults_from(locals())
        if stream and not use_thread:
            raise ValueError("run(stream=True) needs use_thread=True")
        be = resolve_backend(backend)
        state = self._start(be, args, kwargs, defaults, stream, timeout, use_thread)
        if not stream and state.error() is not None:
            raise state.error()
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[list[Any]] | tuple,
        *,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        timeout: float | None = None,
        raise_errors: bool = True,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per entry of ``batch_kwargs`` (dicts of arguments, or lists of
        positional ones) on ``num_threads`` threads, after caching the program's constant
        prefix once. A failed program raises ``ProgramBatchError`` (with every state) once
        all are done, or, with ``raise_errors=False``, stays in its state.
        ``generator_style=True`` returns an iterator of the states, in order, as they end."""
        defaults = _defaults_from(locals())
        batch = self._batch_arguments(batch_kwargs)
        be = resolve_backend(backend)
        if len(batch) > 1 and global_config.enable_precache_with_tracing:
            self.cache(be)
        if num_threads == "auto":
            num_threads = max(64, (os.cpu_count() or 1) * 16)
        workers = max(1, min(int(num_threads), len(batch) or 1))
        states = self._run_pool(be, batch, defaults, workers, progress_bar, timeout)
        if generator_style:
            return self._checked_iter(states, raise_errors)
        return self._checked(list(states), raise_errors)

    def _batch_arguments(self, batch_kwargs: Any) -> list[dict[str, Any]]:
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of dicts (or lists) of program arguments")
        out = []
        required = len(self.arg_names) - len(self.arg_defaults)
        for kw in batch_kwargs:
            if isinstance(kw, dict):
                out.append(dict(kw))
            elif isinstance(kw, (list, tuple)) and required <= len(kw) <= len(self.arg_names):
                out.append(dict(zip(self.arg_names, kw)))
            else:
                raise TypeError(
                    f"run_batch entry {kw!r} does not match {self.func.__name__}"
                    f"{tuple(self.arg_names)}: give a dict or a list of positional arguments"
                )
        return out

    def _run_pool(
        self,
        be: Backend,
        batch: list[dict[str, Any]],
        defaults: SamplingArgs,
        workers: int,
        progress_bar: bool,
        timeout: float | None,
    ) -> Iterator[ProgramState]:
        """The states in order; the pool starts every program at once."""
        with (
            tqdm(total=len(batch), disable=not progress_bar, desc=self.func.__name__) as bar,
            ThreadPoolExecutor(workers) as pool,
        ):

            def one(kw: dict[str, Any]) -> ProgramState:
                try:
                    return self._start(be, (), kw, defaults, False, timeout)
                finally:
                    bar.update(1)

            yield from pool.map(one, batch)

    @staticmethod
    def _checked(states: list[ProgramState], raise_errors: bool) -> list[ProgramState]:
        failed = [s for s in states if s.error() is not None]
        if failed and raise_errors:
            raise ProgramBatchError(
                f"{len(failed)} of {len(states)} programs failed; first "
                f"error: {failed[0].error()!r}",
                states,
            ) from failed[0].error()
        return states

    @staticmethod
    def _checked_iter(states: Iterator[ProgramState], raise_errors: bool) -> Iterator[ProgramState]:
        for state in states:
            if raise_errors and state.error() is not None:
                raise ProgramBatchError(f"a program failed: {state.error()!r}", [state]) from (
                    state.error()
                )
            yield state

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
        use_thread: bool = True,
    ) -> ProgramState:
        kwargs = {**self.bind_arguments, **kwargs}
        deadline = None if timeout is None else time.monotonic() + timeout
        executor = StreamExecutor(
            backend,
            kwargs,
            defaults,
            backend.get_chat_template(),
            stream,
            deadline,
            use_thread=use_thread,
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
        if global_config.verbosity >= 2 and executor.error is None:
            print(executor.text_)  # SGLang's verbosity 2: the final text of every run
        return state


def _defaults_from(arguments: dict[str, Any]) -> SamplingArgs:
    return _sampling_defaults(**{k: arguments[k] for k in _SAMPLING_KEYS})


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


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: ``@sgl.function`` (or ``@sgl.function(num_api_spec_tokens=...)``).

    ``num_api_spec_tokens`` is kept on the program (SGLang uses it to batch the gens of
    hosted chat APIs); radixlm's backends run each gen as its own request."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
