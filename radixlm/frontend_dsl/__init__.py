"""The frontend DSL: ``@function`` programs compiled into backend calls (SGLang's API)."""

from radixlm.frontend_dsl.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    tool_result,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.frontend_dsl.backends import (
    Backend,
    BackendError,
    LocalBackend,
    OpenAI,
    Runtime,
    RuntimeEndpoint,
)
from radixlm.frontend_dsl.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.frontend_dsl.global_config import global_config
from radixlm.frontend_dsl.program import (
    ProgramBatchError,
    SglFunction,
    function,
    get_default_backend,
    set_default_backend,
)
from radixlm.frontend_dsl.state import ProgramState, ProgramStateGroup
from radixlm.frontend_dsl.tool_schema import function_tool
from radixlm.frontend_dsl.tools import ToolCall

__all__ = [
    "Backend",
    "BackendError",
    "LocalBackend",
    "OpenAI",
    "ProgramBatchError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "SglFunction",
    "ToolCall",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "function_tool",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "tool_result",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
