"""``sgl.global_config``: process-wide settings of the frontend (SGLang's names)."""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    """Mutable settings read by every program run.

    - ``default_backend``: where programs run without ``backend=`` (``set_default_backend``).
    - ``verbosity``: 2 prints each program's final text after ``run`` (SGLang's debug aid).
    - ``skip_special_tokens_in_output``, ``spaces_between_special_tokens_in_out``: sent with
      every generation of the native backends (``RuntimeEndpoint``, ``Runtime``, Engine).
    - ``enable_precache_with_tracing``: ``run_batch`` caches the program's constant prefix
      before the batch.
    """

    def __init__(self) -> None:
        self.verbosity = 0
        self.default_backend: Any = None
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True


global_config = GlobalConfig()
