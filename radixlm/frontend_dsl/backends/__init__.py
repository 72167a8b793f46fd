"""Where DSL programs run: in-process (``LocalBackend``), a radixlm/SGLang server
(``RuntimeEndpoint``, ``Runtime``), or any OpenAI-compatible server (``OpenAI``)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from radixlm.frontend_dsl.backends.base import Backend, BackendError, NativeBackend, Prompt
from radixlm.frontend_dsl.backends.http import RuntimeEndpoint
from radixlm.frontend_dsl.backends.local import LocalBackend
from radixlm.frontend_dsl.backends.openai import OpenAI
from radixlm.frontend_dsl.backends.runtime import Runtime

_wrapped_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def as_backend(obj: Any) -> Backend:
    """A Backend for ``obj``: a Backend itself, a Runtime's endpoint (as SGLang unwraps
    ``backend.endpoint``), or an in-process Engine (wrapped once)."""
    if isinstance(obj, Backend):
        return obj
    if isinstance(getattr(obj, "endpoint", None), Backend):
        return obj.endpoint
    if hasattr(obj, "generate") and hasattr(obj, "tokenizer"):
        with _lock:
            wrapped = _wrapped_engines.get(obj)
            if wrapped is None:
                wrapped = _wrapped_engines[obj] = LocalBackend(obj)
        return wrapped
    raise TypeError(
        f"{type(obj).__name__} is not a backend; expected radixlm.Engine, "
        "RuntimeEndpoint, Runtime or OpenAI"
    )


__all__ = [
    "Backend",
    "BackendError",
    "LocalBackend",
    "NativeBackend",
    "OpenAI",
    "Prompt",
    "Runtime",
    "RuntimeEndpoint",
    "as_backend",
]
