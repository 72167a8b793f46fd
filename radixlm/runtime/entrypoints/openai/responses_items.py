"""Responses API items <-> the chat-completions shapes ``openai_api.py`` serves.

Input (OpenAI's mapping, as vLLM's and SGLang's translations do):

- ``instructions`` -> a leading ``system`` message (not carried by ``previous_response_id``);
- a ``message`` item -> a chat message (``developer`` becomes ``system``; ``input_text``,
  ``output_text`` and ``refusal`` parts are joined into its text);
- ``function_call`` items -> ``tool_calls`` of an assistant message (merged into the
  assistant message just before them, as a chat model emits text and calls in one turn);
- ``function_call_output`` -> a ``tool`` message with its ``tool_call_id``;
- a ``reasoning`` item -> the ``reasoning_content`` of the assistant message it opens (the
  message and calls after it join that message), as vLLM replays it;
- function ``tools`` -> chat ``tools`` (``{"type": "function", "function": {...}}``).

The items are kept as read (``input_messages``' ``kept``): each with an id, its text parts
``{"type", "text"}``, and no field the server ignores, which is what the store holds and
``GET .../input_items`` lists.

Output: a chat choice's ``reasoning_content`` (``--reasoning-parser``) -> a ``reasoning``
item with one ``reasoning_text`` part (OpenAI's and vLLM's shape: ``summary`` empty, no
``encrypted_content``); its content -> a ``message`` item with one ``output_text`` part;
its ``tool_calls`` -> ``function_call`` items whose ``call_id`` is the chat call's id.
"""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from radixlm.runtime.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolIn,
    MessageItem,
    ReasoningItem,
)
from radixlm.runtime.entrypoints.validation_errors import describe
from radixlm.runtime.managers.api_error import ApiError

M = TypeVar("M", bound=BaseModel)
_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse_at(model: type[M], data: Any, where: str) -> M:
    """``data`` parsed as ``model``; a 400 naming ``where`` and the field otherwise."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        message, param = describe(e)
        raise ApiError(400, f"{where}.{message}" if param else f"{where}: {message}",
                       param=f"{where}.{param}" if param else where) from None


def _parts(content: str | list[dict[str, Any]], where: str, refusal_ok: bool,
           text_type: str) -> list[dict[str, Any]]:
    """A message's content as ``{"type", "text"}`` (or refusal) parts; a string is one
    ``text_type`` part."""
    if isinstance(content, str):
        return [{"type": text_type, "text": content}]
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        at = f"{where}.content[{j}]"
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": kind, "text": part["text"]})
        elif kind == "refusal" and refusal_ok and isinstance(part.get("refusal"), str):
            parts.append({"type": kind, "refusal": part["refusal"]})
        elif kind in _MEDIA_PARTS:
            raise ApiError(400, f"{at}.type {kind!r} is not supported: radixlm serves "
                           "text-only models (input_text parts only)", param=f"{at}.type")
        else:
            raise ApiError(400, f"{at} must be an input_text or output_text part with a "
                           f"string text{' (or a refusal)' if refusal_ok else ''}, got "
                           f"type {kind!r}", param=at)
    return parts


def _joined(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", p.get("refusal", "")) for p in parts)


def input_messages(items: str | list[dict[str, Any]] | None,
                   kept: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (a string is one user message); each
    item as read appended to ``kept`` when given."""
    if items is None:
        return []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        kind = raw.get("type", "message" if "role" in raw else None)
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ApiError(400, f"{where}.type {kind!r} is not supported: radixlm takes "
                           "message, function_call, function_call_output and reasoning "
                           "items (no hosted tools or item references)", param=f"{where}.type")
        item = parse_at(model, {**raw, "type": kind}, where)
        read = _append(messages, item, where)
        if kept is not None:
            kept.append({"id": item.id or new_id(_ID_PREFIX[item.type]), **read})
    return messages


def _append(messages: list[dict[str, Any]], item: BaseModel, where: str) -> dict[str, Any]:
    """Add ``item`` to the chat ``messages``; the item as read (without its id)."""
    last = messages[-1] if messages else None
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        assistant = item.role == "assistant"
        parts = _parts(item.content, where, assistant,
                       "output_text" if assistant else "input_text")
        if assistant and _thinking_only(last):
            last["content"] = _joined(parts)  # the answer after a replayed reasoning item
        else:
            messages.append({"role": role, "content": _joined(parts)})
        return {"type": "message", "role": item.role, "content": parts}
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return {"type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments}
    if isinstance(item, ReasoningItem):
        return _append_reasoning(messages, item, where)
    assert isinstance(item, FunctionCallOutputItem), item
    output: str | list[dict[str, Any]] = item.output
    if not isinstance(output, str):
        output = _parts(output, f"{where}.output", False, "input_text")
    messages.append({"role": "tool", "tool_call_id": item.call_id,
                     "content": output if isinstance(output, str) else _joined(output)})
    return {"type": "function_call_output", "call_id": item.call_id, "output": output}


def _thinking_only(message: dict[str, Any] | None) -> bool:
    """Whether ``message`` is an assistant turn opened by a reasoning item, still without
    an answer or calls."""
    return message is not None and message["role"] == "assistant" \
        and "reasoning_content" in message and not message["content"] \
        and not message.get("tool_calls")


def _append_reasoning(messages: list[dict[str, Any]], item: ReasoningItem,
                      where: str) -> dict[str, Any]:
    if item.encrypted_content is not None:
        raise ApiError(400, f"{where}.encrypted_content is not supported: radixlm cannot "
                       "read another service's encrypted reasoning; send its content (or "
                       "drop the item)", param=f"{where}.encrypted_content")
    parts = item.content if item.content is not None else item.summary
    text = "".join(p.text for p in parts)
    messages.append({"role": "assistant", "content": "", "reasoning_content": text})
    summary = [p.model_dump() for p in item.summary]
    content = None if item.content is None else [p.model_dump() for p in item.content]
    return {"type": "reasoning", "summary": summary, "content": content}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function ``tools`` in chat's shape; a 400 naming a hosted tool or a tool option
    radixlm lacks."""
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        where = f"tools[{i}]"
        if raw.get("type") != "function":
            raise ApiError(400, f"{where}.type {raw.get('type')!r} is not supported: radixlm "
                           "serves function tools only (no web_search, file_search, "
                           "computer, code_interpreter, mcp or other hosted tools)",
                           param=f"{where}.type")
        for option in ("defer_loading", "async"):
            if raw.get(option):
                raise ApiError(400, f"{where}.{option} is not supported: radixlm offers every "
                               "tool in the prompt and returns calls with the response",
                               param=f"{where}.{option}")
        tool = parse_at(FunctionToolIn, raw, where)
        function: dict[str, Any] = {"name": tool.name,
                                    "parameters": tool.parameters or {"type": "object"}}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat's shape: ``none``, ``auto``, ``required`` or a function."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, f"tool_choice {choice!r} is not supported: radixlm takes 'none', "
                   "'auto', 'required' or {'type': 'function', 'name': ...} (no hosted "
                   "tools or allowed_tools)", param="tool_choice")


# --- output --------------------------------------------------------------------------------
def message_item(item_id: str, text: str, status: str,
                 logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part]}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"].get("arguments") or ""}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": status}


def output_items(choice: dict[str, Any], status: str, want_logprobs: bool
                 ) -> list[dict[str, Any]]:
    """A chat choice (``message``, ``logprobs``) as Responses output items."""
    message = choice["message"]
    calls = message.get("tool_calls") or []
    items = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status))
    text = message.get("content") or ""
    if text or not (calls or reasoning):  # an empty answer is one empty message
        lps = (choice.get("logprobs") or {}).get("content") or [] if want_logprobs else None
        items.append(message_item(new_id("msg"), text, status, lps))
    items.extend(call_item(new_id("fc"), call, status) for call in calls)
    return items


def history_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later turn renders (``previous_response_id``)."""
    return input_messages([{k: v for k, v in item.items() if k != "id"} for item in output])
