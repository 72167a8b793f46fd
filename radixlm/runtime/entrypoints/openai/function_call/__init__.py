"""OpenAI tool calling: request tools -> template tools, sampling constraint, output parser.

The interface every endpoint uses (chat completions; the Responses API converts its
function tools to the same shape)::

    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                      server_args.tool_call_parser)         # None: no tools; ApiError: 400
    render_chat(conversation, tools=plan.template_tools)
    kind, spec = plan.constraint() or (None, None)           # sp[kind] = spec
    parser = plan.new_parser()                               # one per choice
    content, calls = parser.parse(text)                      # ToolCall: name, arguments, id
    text_delta, call_deltas = parser.feed(delta); ... parser.finish()

Layout: core.py (calls, the format interface, JSON helpers), scan.py (scans that go on
where they stopped as the text grows: every parser is linear in its output), driver.py
(the one parser, whole or streamed), one module per format (hermes.py, llama3.py,
mistral.py, pythonic.py, harmony.py, json_array.py for forced calls), registry.py
(--tool-call-parser names), tools.py (checking the request; the plan).
"""

from radixlm.runtime.entrypoints.openai.function_call.core import ToolCall
from radixlm.runtime.entrypoints.openai.function_call.driver import CallDelta, ToolCallParser
from radixlm.runtime.entrypoints.openai.function_call.registry import (
    TOOL_CALL_PARSERS,
    tool_call_format,
)
from radixlm.runtime.entrypoints.openai.function_call.tools import (
    FunctionTool,
    ToolPlan,
    plan_tools,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallDelta",
    "FunctionTool",
    "ToolCall",
    "ToolCallParser",
    "ToolPlan",
    "plan_tools",
    "tool_call_format",
]
