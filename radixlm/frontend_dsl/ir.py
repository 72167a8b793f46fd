"""Expression nodes of a DSL program.

A program appends expressions to its state (``s += ...``): constant text, ``Gen`` and
``Select`` calls, role markers, variable scopes. ``a + b`` builds an ``ExprList`` so
``sgl.user("hi") + sgl.assistant(sgl.gen("x"))`` is one expression.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every node; ``+`` concatenates into an ``ExprList``."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr]

    def flatten(self) -> list[Expr]:
        out: list[Expr] = []
        for e in self.exprs:
            out.extend(e.flatten() if isinstance(e, ExprList) else [e])
        return out


@dataclass(eq=False)
class ConstantText(Expr):
    value: str


@dataclass
class SamplingArgs:
    """Sampling options of one ``gen``; None means "take the program's default"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def merged_over(self, defaults: SamplingArgs) -> SamplingArgs:
        """These args, with every None field taken from ``defaults``."""
        values = {
            f.name: getattr(self, f.name)
            if getattr(self, f.name) is not None
            else getattr(defaults, f.name)
            for f in dataclasses.fields(self)
        }
        return SamplingArgs(**values)

    def to_sampling_params(self) -> dict[str, Any]:
        """The ``sampling_params`` of a native ``/generate`` request (set fields only)."""
        request_only = {
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
        }
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name not in request_only:
                out[f.name] = list(value) if isinstance(value, list) else value
        return out


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    args: SamplingArgs = field(default_factory=SamplingArgs)
    dtype: str | None = None  # int/float/bool/str: the regex came from it
    tools: Any = None  # a tools.ToolSpec: the tools offered to this gen


@dataclass(eq=False)
class ToolResult(Expr):
    """A ``tool`` message: the output of the call ``call_id`` (``api.tool_result``)."""

    call_id: str
    content: str


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Callable[..., Any]


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class Variable(Expr):
    """The value of another variable of this state, appended as text."""

    name: str


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """Split the text of variable ``source`` into reasoning (kept in ``name``,
    ``<source>_reasoning_content``) and the answer (left in ``source`` and the text)."""

    source: str
    model_type: str

    @property
    def name(self) -> str:
        return reasoning_var_name(self.source)


def reasoning_var_name(source: str | None) -> str:
    if not source:
        raise ValueError("separate_reasoning() needs a named gen or select: gen('answer')")
    return f"{source}_reasoning_content"


@dataclass(eq=False)
class CommitLazy(Expr):
    """Send the text so far to the backend to cache its KV (before a fork)."""


@dataclass(eq=False)
class ConcatenateAndAppend(Expr):
    """Append the texts that forks added after the fork point (``join`` mode)."""

    texts: list[str]


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ConstantText(str(value))
    raise TypeError(
        f"cannot add a {type(value).__name__} to a program; "
        "expected str, a number or an sgl expression"
    )


def flatten(value: Any) -> list[Expr]:
    expr = to_expr(value)
    return expr.flatten() if isinstance(expr, ExprList) else [expr]
