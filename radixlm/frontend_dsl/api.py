"""The DSL's public functions: ``gen``, ``select``, roles, backend helpers.

Names and arguments follow SGLang's frontend so programs run with ``import radixlm as sgl``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

from radixlm.frontend_dsl.choices import ChoicesSamplingMethod, token_length_normalized
from radixlm.frontend_dsl.dtype_regex import dtype_to_regex
from radixlm.frontend_dsl.ir import (
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    SamplingArgs,
    Select,
    SeparateReasoning,
    ToolResult,
    flatten,
    reasoning_var_name,
    to_expr,
)
from radixlm.frontend_dsl.program import get_default_backend, resolve_backend
from radixlm.frontend_dsl.reasoning import reasoning_format
from radixlm.frontend_dsl.tools import ToolCall, make_tool_spec, result_text


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    ebnf: str | None = None,
    repetition_penalty: float | None = None,
    tools: list[dict[str, Any] | Callable[..., Any]] | None = None,
    tool_choice: str | dict[str, Any] | Callable[..., Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> Expr:
    """Generate text into variable ``name`` (SGLang's parameters, in SGLang's order, then
    radixlm's ``ebnf`` and ``repetition_penalty``). Unset arguments take the defaults given
    to ``run(...)``. ``choices=[...]`` makes it a ``select``; ``dtype`` (int, float, bool,
    str) constrains the text with a regex (and, as in SGLang, wins over ``regex``).

    ``tools`` (OpenAI tool dicts or Python functions), ``tool_choice`` (``"auto"``, the
    default, ``"required"``, ``"none"``, a tool's name or OpenAI's named form) and
    ``parallel_tool_calls`` offer tools as chat completions does: the gen must open an
    ``assistant(...)`` turn; ``s[name]`` is the reply's text and ``s.tool_calls(name)``
    its calls (``tools.ToolCall``); ``tool_result(call, output)`` answers one."""
    spec = make_tool_spec(tools, tool_choice, parallel_tool_calls)
    if spec is not None and (choices or dtype is not None or regex is not None
                             or json_schema is not None or ebnf is not None):
        raise ValueError("gen() takes tools or one of choices, dtype, regex, json_schema and "
                         "ebnf, not both: the tools' grammar holds the output")
    if choices:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    if regex is not None:
        re.compile(regex)  # as SGLang: a bad pattern fails here, as re.error
    dtype_name = None
    if dtype is not None:
        if regex is not None:
            warnings.warn(
                f"gen({name!r}) has both dtype and regex; only dtype is used", stacklevel=2
            )
        regex = dtype_to_regex(dtype)
        dtype_name = dtype if isinstance(dtype, str) else dtype.__name__
    if sum(x is not None for x in (regex, json_schema, ebnf)) > 1:
        raise ValueError("gen() takes at most one of regex (or dtype), json_schema and ebnf")
    args = SamplingArgs(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
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
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    return Gen(name, args, dtype_name, spec)


def tool_result(call: ToolCall | str, output: Any) -> Expr:
    """A ``tool`` message answering ``call`` (a ``ToolCall`` or its id) with ``output``
    (text, or anything JSON-serialisable): OpenAI's ``{"role": "tool", "tool_call_id":
    ..., "content": ...}``, rendered by the model's chat template. It goes between turns,
    after the assistant turn that made the call."""
    call_id = call.id if isinstance(call, ToolCall) else call
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"tool_result() takes a ToolCall or its id, got {call!r}")
    return ToolResult(call_id, result_text(output))


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Expr:
    """``gen(..., dtype=int)`` (SGLang's positional order)."""
    return gen(**locals(), dtype=int)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Expr:
    """``gen(..., dtype=str)``: a double-quoted string (SGLang's positional order)."""
    return gen(**locals(), dtype=str)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Pick one of ``choices`` by the logprobs of prefix + choice (``choices_method``)."""
    if not choices:
        raise ValueError("select() needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select() choices must be non-empty strings, got {choices!r}")
    return Select(name, list(choices), temperature, choices_method)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    """``expr`` (a named gen or select, or a list of them), then split each one's text into
    its reasoning (variable ``<name>_reasoning_content``) and its answer (the variable and
    the program's text keep only the answer). ``model_type`` is SGLang's reasoning-parser
    name (``deepseek-r1``, ``qwen3``, ...)."""
    reasoning_format(model_type)  # an unknown model type fails here, not mid-program
    if expr is None:
        return ExprList([])
    sources = [e.name for e in flatten(expr) if isinstance(e, (Gen, Select))]
    for source in sources:
        reasoning_var_name(source)
    return ExprList([to_expr(expr), *(SeparateReasoning(n, model_type) for n in sources)])


def image(expr: Any) -> Expr:
    """SGLang's ``sgl.image``: refused, radixlm serves text-only models."""
    raise NotImplementedError(
        "sgl.image(): radixlm serves text-only models; images are not supported"
    )


def video(path: str, num_frames: int) -> Expr:
    """SGLang's ``sgl.video``: refused, radixlm serves text-only models."""
    raise NotImplementedError(
        "sgl.video(): radixlm serves text-only models; video is not supported"
    )


def _role(role: str, expr: Any) -> Expr:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> Expr:
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Empty the runtime's prefix cache; False when there is no backend (as SGLang)."""
    if backend is None and get_default_backend() is None:
        return False
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The server's ``/server_info``; None when there is no backend (as SGLang)."""
    if backend is None and get_default_backend() is None:
        return None
    return resolve_backend(backend).get_server_info()
