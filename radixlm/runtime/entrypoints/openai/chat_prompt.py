"""The chat route's input side: messages (tool calls and results included) -> the
template's conversation and prompt; tools -> the sampling constraint; and the parsers each
choice's output goes through (``ChoiceOutput``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from radixlm.runtime.entrypoints.openai.chat_output import ChoiceOutput
from radixlm.runtime.entrypoints.openai.function_call import ToolCallParser, ToolPlan, plan_tools
from radixlm.runtime.entrypoints.openai.function_call.harmony import HarmonyFormat
from radixlm.runtime.entrypoints.openai.reasoning_parser import (
    THINK_END,
    ReasoningParser,
    starts_in_reasoning,
)
from radixlm.runtime.entrypoints.protocol import ChatCompletionRequest, ChatMessage
from radixlm.runtime.executor.sampling_params import GRAMMAR_FIELDS
from radixlm.runtime.managers.api_error import ApiError

# apply_chat_template's own arguments: not the client's to set
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                              "add_generation_prompt", "chat_template", "return_dict",
                              "continue_final_message", "tokenizer_kwargs", "padding",
                              "truncation", "max_length", "return_tensors"})


def _arguments(text: str | dict[str, Any]) -> Any:
    """A call's arguments for the template: the object (HF templates ``tojson`` it, as
    vLLM passes it), or the text when it is not JSON."""
    if isinstance(text, dict):
        return text
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The template's messages: text content; an assistant's ``tool_calls`` (legacy
    ``function_call`` too) and tool results (legacy ``function`` role: ``tool``)."""
    conv = []
    for m in messages:
        content = m.content or ""
        if isinstance(content, list):  # content parts (text only; checked at the edge)
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": "tool" if m.role == "function" else m.role,
                               "content": content}
        calls = [(c.id, c.function) for c in m.tool_calls or []]
        if m.function_call is not None:
            calls.append((None, m.function_call))
        if calls:
            msg["tool_calls"] = [
                {"id": call_id, "type": "function",
                 "function": {"name": fn.name, "arguments": _arguments(fn.arguments)}}
                for call_id, fn in calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        conv.append(msg)
    return conv


def conversation_text(conv: list[dict[str, Any]]) -> str:
    """Every text the template will see (for the length check before it runs)."""
    parts = [m["content"] for m in conv]
    for m in conv:
        parts += [json.dumps(c["function"]) for c in m.get("tool_calls", ())]
    return "".join(parts)


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    bad = sorted(set(kwargs) & _RESERVED_KWARGS)
    if bad:
        raise ApiError(400, f"chat_template_kwargs may not set {bad[0]!r} (the server sets "
                            "it)", param="chat_template_kwargs")
    return kwargs


def tool_plan(body: ChatCompletionRequest, parser_name: str | None) -> ToolPlan | None:
    return plan_tools(body.tools, _plain(body.tool_choice), body.parallel_tool_calls,
                      parser_name, functions=body.functions,
                      function_call=_plain(body.function_call))


def _plain(choice: str | BaseModel | None) -> str | dict[str, Any] | None:
    """A choice as the JSON it came as (``plan_tools`` takes any caller's)."""
    return choice.model_dump() if isinstance(choice, BaseModel) else choice


def special_token_texts(tokenizer: Any) -> frozenset[str]:
    """The tokenizer's special tokens as text (what no grammar can produce)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset({*(getattr(tokenizer, "all_special_tokens", []) or []),
                      *(t.content for t in added.values() if getattr(t, "special", False))})


def constrain(plan: ToolPlan | None, sp: dict[str, Any],
              special_tokens: frozenset[str] = frozenset()) -> None:
    """Put the tools' grammar into the sampling params. Beside ``response_format`` (or
    another grammar): a forced call (``required``, named) is held to the calls' grammar,
    the format applying to the text answers of later turns (the Agents SDK forces a tool,
    then asks for its ``output_type`` under ``auto``); under ``auto`` the text is held to
    the format, as vLLM does: the model answers in it and cannot call a tool that turn."""
    if plan is not None and plan.keep_special_tokens:
        sp.setdefault("skip_special_tokens", False)
    found = plan.constraint(special_tokens) if plan is not None else None
    if found is None:
        return
    other = [k for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if other and not plan.forced:
        return
    for k in other:
        sp.pop(k)
    kind, spec = found
    sp[kind] = spec


def choice_outputs(body: ChatCompletionRequest, plan: ToolPlan | None,
                   reasoning_name: str | None, prompt: str, sp: dict[str, Any]
                   ) -> Callable[[], ChoiceOutput] | None:
    """A factory of each choice's output reader, or None (plain text)."""
    reasoning = reasoning_name if body.separate_reasoning else None
    thinking = reasoning_name is not None and starts_in_reasoning(reasoning_name, prompt)
    if thinking and any(sp.get(k) is not None for k in GRAMMAR_FIELDS):
        sp["reasoning_end"] = THINK_END  # the grammar holds the answer after the thinking
    if reasoning == "gpt-oss":
        sp.setdefault("skip_special_tokens", False)
    parses = plan is not None and plan.parses
    if reasoning is None and not parses:
        return None

    def make() -> ChoiceOutput:
        r = ReasoningParser(reasoning, thinking) if reasoning else None
        tools = plan.new_parser() if parses else None
        if tools is None and reasoning == "gpt-oss":  # harmony markup out of the text
            return ChoiceOutput(r, ToolCallParser(HarmonyFormat()), drop_calls=True,
                                stream_reasoning=body.stream_reasoning)
        return ChoiceOutput(r, tools, stream_reasoning=body.stream_reasoning)

    return make
