"""radixlm: an SGLang-style structured generation runtime.

``radixlm.Engine`` runs offline generation in-process; ``radixlm serve`` starts the server.
The frontend DSL (``function``, ``gen``, ``select``, roles, backends) is SGLang's, so
programs written for SGLang run with ``import radixlm as sgl``.

Importing radixlm before torch lets it set OpenMP's wait policy (a short spin, then sleep:
``runtime/openmp_env.py``) while torch has not loaded OpenMP yet.
"""

import importlib
from typing import TYPE_CHECKING, Any

from radixlm.runtime.openmp_env import set_openmp_defaults

set_openmp_defaults()  # before anything below imports torch

if TYPE_CHECKING:
    from radixlm.frontend_dsl import (
        Backend,
        BackendError,
        LocalBackend,
        OpenAI,
        ProgramBatchError,
        ProgramState,
        ProgramStateGroup,
        Runtime,
        RuntimeEndpoint,
        SglFunction,
        ToolCall,
        assistant,
        assistant_begin,
        assistant_end,
        flush_cache,
        function,
        function_tool,
        gen,
        gen_int,
        gen_string,
        get_default_backend,
        get_server_info,
        global_config,
        greedy_token_selection,
        image,
        select,
        separate_reasoning,
        set_default_backend,
        system,
        system_begin,
        system_end,
        token_length_normalized,
        tool_result,
        unconditional_likelihood_normalized,
        user,
        user_begin,
        user_end,
        video,
    )
    from radixlm.runtime.config import ServerArgs  # noqa: E402
    from radixlm.runtime.entrypoints.engine.engine import Engine  # noqa: E402

__all__ = [
    "Backend",
    "BackendError",
    "Engine",
    "LocalBackend",
    "OpenAI",
    "ProgramBatchError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "ServerArgs",
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
__version__ = "0.1.0"

# The names above load on first use: a process that needs one part (the compile worker,
# the detokenizer, the CLI) does not pay seconds of imports for the rest.
_HOMES = {"Engine": "radixlm.runtime.entrypoints.engine.engine",
          "ServerArgs": "radixlm.runtime.config"}  # the others: radixlm.frontend_dsl


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, "radixlm.frontend_dsl")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
