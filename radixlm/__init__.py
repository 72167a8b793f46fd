"""radixlm: an SGLang-style structured generation runtime.

``radixlm.Engine`` runs offline generation in-process; ``radixlm serve`` starts the server.
The frontend DSL (``function``, ``gen``, ``select``, roles, backends) is SGLang's, so
programs written for SGLang run with ``import radixlm as sgl``.
"""

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
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    greedy_token_selection,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.engine import Engine

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
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
__version__ = "0.1.0"
