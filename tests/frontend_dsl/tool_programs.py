"""What the DSL tool tests share: tools as Python functions, their schemas, and a program
that makes a forced call, answers it and asks the next turn. The arguments are enums and
booleans so that random weights end a call within a few tokens (an integer could run on)."""

from __future__ import annotations

from typing import Literal

import jsonschema

import radixlm as sgl


def get_weather(city: Literal["Paris", "Oslo", "Lima"], metric: bool,
                unit: Literal["C", "F"] | None = None) -> str:
    """The forecast for a city.

    Args:
        city: where
        metric: Celsius when true
        unit: overrides metric
    """
    return f"sunny in {city}"


def get_time(zone: Literal["CET", "UTC"]) -> str:
    """The time in a zone."""
    return f"noon {zone}"


TOOLS = [get_weather, get_time]
FUNCTIONS = {f.__name__: f for f in TOOLS}
SCHEMAS = {f.__name__: sgl.function_tool(f)["function"]["parameters"] for f in TOOLS}
QUESTION = "Weather in Paris?"


@sgl.function
def round_trip(s, question, choice):
    """Call (forced), answer each call, then a next turn offered the same tools."""
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("call", tools=TOOLS, tool_choice=choice, max_tokens=200,
                               temperature=0))
    for call in s.tool_calls("call"):
        s += sgl.tool_result(call, FUNCTIONS[call.name](**call.arguments))
    s += sgl.assistant(sgl.gen("answer", tools=TOOLS, tool_choice="none", max_tokens=4,
                               temperature=0))


def check_calls(calls, allowed: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.name in allowed, call
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def equivalent_messages(state) -> list[dict]:
    """The conversation before the last turn, written as an OpenAI client would (the
    arguments as objects, as the server hands them to the template)."""
    msgs = [{"role": "user", "content": QUESTION}]
    calls = state.tool_calls("call")
    msgs.append({"role": "assistant", "content": state["call"], "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
    for c in calls:
        msgs.append({"role": "tool", "tool_call_id": c.id,
                     "content": FUNCTIONS[c.name](**c.arguments)})
    return msgs
