"""Finds the constant prefix of a program: the text every run starts with.

The program runs once, synchronously, with placeholders for its unbound arguments and a
backend that stops at the first ``gen``/``select``/fork. Text is rendered by the real
executor (same chat template), so the prefix is byte-identical to what real runs send;
``run_batch`` caches it once before the batch starts. Anything that depends on an
argument (formatting it, branching on it, reading a generated variable) ends the prefix.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from radixlm.frontend_dsl.backends.base import Backend, Prompt
from radixlm.frontend_dsl.chat_template import ChatTemplate
from radixlm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod
from radixlm.frontend_dsl.interpreter import StreamExecutor
from radixlm.frontend_dsl.ir import Expr, SamplingArgs
from radixlm.frontend_dsl.state import ProgramState

logger = logging.getLogger(__name__)


class StopTracing(Exception):
    """The program reached something that is not constant."""


class ArgumentPlaceholder(Expr):
    """Stands in for an unbound argument; any use of its value stops tracing."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _stop(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise StopTracing(f"argument {self.name!r} is used")

    __str__ = __format__ = __bool__ = __len__ = __iter__ = __getitem__ = _stop  # type: ignore
    __int__ = __float__ = __contains__ = __call__ = __eq__ = __lt__ = _stop  # type: ignore
    __hash__ = object.__hash__

    def __getattr__(self, attr: str) -> Any:
        raise StopTracing(f"argument {self.__dict__.get('name')!r} is used (.{attr})")


class _TracingBackend(Backend):
    def __init__(self, chat_template: ChatTemplate) -> None:
        self.chat_template = chat_template

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], logprob_args: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        raise StopTracing("gen")

    def generate_stream(
        self, prompt: Prompt, sampling_params: dict[str, Any], logprob_args: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        raise StopTracing("gen")

    def select(
        self,
        prompt: Prompt,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        raise StopTracing("select")

    def cache_prefix(self, prompt: Prompt) -> None:
        raise StopTracing("fork")


class _TracingExecutor(StreamExecutor):
    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ArgumentPlaceholder):
            raise StopTracing(f"argument {expr.name!r}")
        super()._execute(expr)


def extract_prefix(
    func: Callable[..., Any], bound: dict[str, Any], chat_template: ChatTemplate
) -> str:
    """The constant text a program starts with, given its ``bound`` arguments."""
    params = list(inspect.signature(func).parameters.values())[1:]
    kwargs = {
        p.name: bound.get(p.name, ArgumentPlaceholder(p.name))
        for p in params
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    executor = _TracingExecutor(
        _TracingBackend(chat_template),
        kwargs,
        SamplingArgs(),
        chat_template,
        stream=False,
        deadline=None,
        use_thread=False,
    )
    try:
        func(ProgramState(executor), **kwargs)
    except StopTracing as e:
        logger.debug("tracing stopped: %s", e)
    except Exception as e:  # noqa: BLE001 - any failure just ends the constant prefix
        logger.debug("tracing stopped by %r", e)
    return executor.text_
