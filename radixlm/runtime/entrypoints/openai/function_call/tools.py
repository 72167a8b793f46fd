"""A request's tools and tool choice, checked, and what serving them takes: the template's
``tools``, the sampling constraint, and a parser for the output (``ToolPlan``).

    plan = plan_tools(tools, tool_choice, parallel_tool_calls, parser_name="qwen25")
    plan.template_tools          # -> apply_chat_template(tools=...)
    plan.constraint()            # -> ("json_schema" | "structural_tag", spec) or None
    plan.new_parser()            # -> ToolCallParser (parse / feed / finish) or None

``tool_choice``: ``"none"`` renders the tools (as vLLM does) but neither constrains nor
parses; ``"auto"`` (the default with tools) needs ``--tool-call-parser``: text is free and
each call, after the format's trigger, is held to its tool's schema (a ``structural_tag``
grammar); ``"required"`` and a named function hold the whole output to a JSON array of
calls (``json_array.py``, SGLang's and vLLM's way), whatever the parser.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.entrypoints.openai.function_call.core import ToolCallFormat
from radixlm.runtime.entrypoints.openai.function_call.driver import ToolCallParser
from radixlm.runtime.entrypoints.openai.function_call.json_array import (
    JsonArrayFormat,
    forced_schema,
)
from radixlm.runtime.entrypoints.openai.function_call.registry import tool_call_format
from radixlm.runtime.managers.api_error import ApiError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 512
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}  # OpenAI's key order: templates tojson it
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served (see the module docstring)."""

    tools: tuple[FunctionTool, ...]
    choice: str  # none | auto | required | function
    named: str | None
    parallel: bool
    fmt: ToolCallFormat | None  # --tool-call-parser's format, None without one

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.to_openai() for t in self.tools] or None

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        """The whole output is a JSON array of calls."""
        return self.choice in ("required", "function")

    def constraint(self, special_tokens: frozenset[str] = frozenset()
                   ) -> tuple[str, dict[str, Any]] | None:
        """(grammar kind, spec) the output is held to, or None (free text).
        ``special_tokens``: the served tokenizer's; a grammar never produces them, so a
        format whose call begins with one (Mistral's ``[TOOL_CALLS]``) is parsed, not
        grammar-held, rather than kept from calling at all."""
        if not self.parses:
            return None
        if self.forced:
            allowed = [t for t in self.tools if self.named in (None, t.name)]
            return "json_schema", forced_schema([(t.name, t.parameters) for t in allowed],
                                                self.parallel and self.named is None)
        structures = []
        for t in self.tools:
            around = self.fmt.structure(t.name)
            if around is None or any(tok in around[0] for tok in special_tokens):
                return None  # pythonic, gpt-oss: calls parsed, not grammar-enforced
            structures.append({"begin": around[0], "schema": t.parameters, "end": around[1]})
        triggers = sorted({tr for tr in self.fmt.triggers
                           if any(s["begin"].startswith(tr) for s in structures)})
        return "structural_tag", {"structures": structures, "triggers": triggers}

    def new_parser(self) -> ToolCallParser | None:
        if not self.parses:
            return None
        fmt = JsonArrayFormat() if self.forced else self.fmt
        return ToolCallParser(fmt, max_calls=None if self.parallel else 1)

    @property
    def keep_special_tokens(self) -> bool:
        """The format is written with special tokens the detokenizer must keep."""
        return self.parses and not self.forced and self.fmt.needs_special_tokens


def _tool(i: int, raw: Any, field: str) -> FunctionTool:
    where = f"{field}[{i}]"
    if field == "tools":
        if not isinstance(raw, dict) or raw.get("type") != "function":
            kind = raw.get("type") if isinstance(raw, dict) else type(raw).__name__
            raise ApiError(400, f"{where}.type must be 'function' (radixlm serves function "
                                f"tools only), got {kind!r}", param=f"{where}.type")
        raw, where = raw.get("function"), f"{where}.function"
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    name, params = raw.get("name"), raw.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{where}.name must be 1 to 64 letters, digits, '_', '-' or '.', "
                            f"got {name!r}", param=f"{where}.name")
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}.parameters must be a JSON schema object",
                       param=f"{where}.parameters")
    desc, strict = raw.get("description"), raw.get("strict")
    if desc is not None and not isinstance(desc, str):
        raise ApiError(400, f"{where}.description must be a string", param=f"{where}.description")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{where}.strict must be a boolean", param=f"{where}.strict")
    return FunctionTool(name, params, desc, strict)


def _choice(raw: Any, field: str, names: set[str]) -> tuple[str, str | None]:
    """(choice, named function) of ``tool_choice`` / legacy ``function_call``."""
    if raw is None:
        return ("auto" if names else "none"), None
    if isinstance(raw, str):
        if raw not in CHOICES or (field == "function_call" and raw == "required"):
            raise ApiError(400, f"{field} must be one of {CHOICES} or a named function, "
                                f"got {raw!r}", param=field)
        return raw, None
    fn = raw.get("function") if field == "tool_choice" else raw
    if field == "tool_choice" and raw.get("type") != "function" or not isinstance(fn, dict):
        raise ApiError(400, f"{field} must be a string or {{\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param=field)
    name = fn.get("name")
    if name not in names:
        raise ApiError(400, f"{field} names function {name!r}, which is not among the "
                            f"request's tools ({', '.join(sorted(names)) or 'none'})",
                       param=field)
    return "function", name


def plan_tools(tools: list[Any] | None, tool_choice: Any = None,
               parallel_tool_calls: bool | None = None, parser_name: str | None = None, *,
               functions: list[Any] | None = None, function_call: Any = None
               ) -> ToolPlan | None:
    """The checked plan of a request's tools (None: the request has none). A 400
    (ApiError naming the field) for a malformed tool or choice, and for ``auto`` when the
    server has no ``--tool-call-parser``. ``functions`` / ``function_call``: OpenAI's
    legacy spelling of ``tools`` / ``tool_choice``."""
    if functions is not None and tools is not None:
        raise ApiError(400, "give tools or the legacy functions, not both", param="functions")
    field, choice_field = ("functions", "function_call") if functions is not None \
        else ("tools", "tool_choice")
    raw = functions if functions is not None else tools
    choice_raw = function_call if functions is not None else tool_choice
    if functions is None and function_call is not None:
        raise ApiError(400, "function_call needs functions (or use tools and tool_choice)",
                       param="function_call")
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise ApiError(400, f"{field} has {len(raw)} entries (limit {MAX_TOOLS})", param=field)
    parsed = [_tool(i, t, field) for i, t in enumerate(raw)]
    names = {t.name for t in parsed}
    if len(names) < len(parsed):
        raise ApiError(400, f"{field} has two functions of the same name", param=field)
    if not parsed and choice_raw not in (None, "none"):
        raise ApiError(400, f"{choice_field} is only allowed when {field} are given",
                       param=choice_field)
    if not parsed:
        return None
    choice, named = _choice(choice_raw, choice_field, names)
    fmt = tool_call_format(parser_name) if parser_name else None
    if choice == "auto" and fmt is None:
        raise ApiError(400, f"{choice_field} 'auto' (the default when {field} are given) "
                            "needs a tool-call parser: start the server with "
                            "--tool-call-parser (e.g. qwen25, llama3, mistral, pythonic, "
                            "gpt-oss), or send tool_choice 'required', a named function "
                            "or 'none'", param=choice_field)
    return ToolPlan(tuple(parsed), choice, named, parallel_tool_calls is not False, fmt)
