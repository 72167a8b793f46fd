"""Tools in programs: what ``gen(tools=...)`` offers, the calls it reads back, and the one
bridge to the server's tool machinery (``radixlm.runtime.entrypoints.openai.function_call``).

The shapes are OpenAI's: tools are ``{"type": "function", "function": {...}}`` dicts (or
Python functions, ``tool_schema.function_tool``); ``tool_choice`` is ``"auto"``,
``"required"``, ``"none"``, ``{"type": "function", "function": {"name": ...}}`` or a bare
tool name; a call is ``ToolCall(id, name, arguments)``. The native backends serve a gen
with tools as the chat route does: ``ToolSpec.plan(parser)`` -> ``ToolPlan``, whose
``constraint()`` goes into the sampling params and whose parser reads the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixlm.frontend_dsl.tool_schema import function_tool
from radixlm.runtime.entrypoints.openai.function_call import ToolPlan, plan_tools, tool_call_format
from radixlm.runtime.managers.api_error import ApiError

CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (OpenAI's ``tool_calls[i]``); ``arguments`` parsed."""

    id: str
    name: str
    arguments_json: str  # the JSON text, as the API carries it
    type: str = "function"

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments object; ValueError when the model's text is not one."""
        try:
            value = json.loads(self.arguments_json)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"tool call {self.name!r} has arguments that are not JSON: "
                             f"{self.arguments_json!r}") from e
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r} has arguments that are not an object: "
                             f"{self.arguments_json!r}")
        return value

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class ToolSpec:
    """A gen's tools, checked: OpenAI tool dicts, the choice, ``parallel_tool_calls``."""

    tools: tuple[dict[str, Any], ...]
    choice: str | dict[str, Any]
    parallel: bool | None = None

    @property
    def tool_list(self) -> list[dict[str, Any]]:
        return list(self.tools)

    def plan(self, parser_name: str | None) -> ToolPlan:
        """How a native backend serves these tools; ``auto`` needs a parser name."""
        if self.choice == "auto" and not parser_name:
            raise ValueError(
                "gen(tool_choice='auto') (the default with tools) needs a tool-call parser: "
                "give the backend tool_call_parser='qwen25' (or llama3, mistral, pythonic, "
                "gpt-oss), or start the server with --tool-call-parser; tool_choice="
                "'required' or a named tool need none")
        plan = _plan(self.tool_list, self.choice, self.parallel, parser_name)
        assert plan is not None, self
        return plan

    def openai_args(self) -> dict[str, Any]:
        """The chat-completions request fields."""
        args: dict[str, Any] = {"tools": self.tool_list, "tool_choice": self.choice}
        if self.parallel is not None:
            args["parallel_tool_calls"] = self.parallel
        return args


def make_tool_spec(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: Any
                   ) -> ToolSpec | None:
    """``gen``'s tool arguments, checked now (ValueError naming the argument), not when
    the program reaches the gen."""
    if tools is None:
        if tool_choice is not None or parallel_tool_calls is not None:
            raise ValueError("gen(tool_choice=..., parallel_tool_calls=...) needs tools=[...]")
        return None
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError(f"gen(tools=...) takes a non-empty list of tools, got {tools!r}")
    dicts = tuple(t if isinstance(t, dict) else function_tool(t) for t in tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"gen(parallel_tool_calls=...) must be a bool, got "
                         f"{parallel_tool_calls!r}")
    choice = _choice(tool_choice)
    _plan(list(dicts), "none" if choice == "auto" else choice, parallel_tool_calls, None)
    return ToolSpec(dicts, choice, parallel_tool_calls)


def _choice(raw: Any) -> str | dict[str, Any]:
    """OpenAI's tool_choice from ``gen``'s: a bare name or a function names a tool."""
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        return raw if raw in CHOICES else {"type": "function", "function": {"name": raw}}
    if callable(raw) and not isinstance(raw, dict):
        return {"type": "function", "function": {"name": raw.__name__}}
    if isinstance(raw, dict):
        return raw
    raise ValueError(f"gen(tool_choice=...) takes 'auto', 'required', 'none', a tool name or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {raw!r}")


def _plan(tools: list[dict[str, Any]], choice: Any, parallel: bool | None,
          parser_name: str | None) -> ToolPlan | None:
    try:
        return plan_tools(tools, choice, parallel, parser_name)
    except ApiError as e:
        raise ValueError(f"gen(): {e.message}") from None


def check_parser_name(name: str | None) -> str | None:
    """``name`` if it is a known ``--tool-call-parser`` (ValueError otherwise)."""
    if name is not None:
        tool_call_format(name)
    return name


def constrained_params(plan: ToolPlan, sampling_params: dict[str, Any],
                       special_tokens: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The sampling params with the tools' grammar (``json_schema`` for a forced call,
    ``structural_tag`` for ``auto``), as the chat route sends them to the scheduler."""
    params = dict(sampling_params)
    if plan.keep_special_tokens:
        params["skip_special_tokens"] = False
    found = plan.constraint(special_tokens)
    if found is not None:
        kind, spec = found
        params[kind] = spec
    return params


def parse_output(plan: ToolPlan, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a generation under ``plan``."""
    parser = plan.new_parser()
    if parser is None:
        return text, []
    content, calls = parser.parse(text)
    return content or "", [ToolCall(c.id, c.name, c.arguments) for c in calls]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A program's messages (OpenAI's wire shapes) as a chat template takes them: each
    call's arguments an object, as the server renders them (``chat_prompt.conversation``)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": _loads_or_text(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        out.append(m)
    return out


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def result_text(output: Any) -> str:
    """A tool's output as the ``tool`` message's content: text as is, else JSON."""
    if isinstance(output, str):
        return output
    try:
        return json.dumps(output, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool_result(): the output must be text or JSON-serialisable, "
                         f"got {type(output).__name__}") from e


