"""How long a queued request waits for its pages from storage before it is scheduled
(``--hicache-storage-prefetch-policy``). It never waits in the scheduler: the request stays
in the queue, skipped, until its load is done or past its deadline; then it takes the pages
that arrived and computes the rest.

- ``auto`` (the default): wait when loading the pages is expected to be faster than
  computing their tokens, and at most as long as computing them would take::

      compute = tokens x measured prefill seconds per token
      load    = pages  x measured seconds per page read
      wait    = compute if load < compute else 0

  Before a prefill has been timed, SGLang's ``timeout`` deadline stands in for ``compute``.
- ``best_effort``: no wait (the pages that arrived by the time it is scheduled).
- ``wait_complete``: until every page is read or missed.
- ``timeout``: SGLang's deadline, ``min(30, 2 + 0.1 x tokens / 1024)`` seconds (SGLang's
  ``PrefetchTimeoutConfig`` defaults; ``timeout`` is SGLang's default policy).

Under every policy a page read that takes longer than the tier's page deadline is a miss
(``StorageTier.poll``), so no request waits forever on one file.
"""

from __future__ import annotations

import math

PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")
TIMEOUT_BASE_S, TIMEOUT_PER_KI_TOKEN_S, TIMEOUT_MAX_S = 2.0, 0.1, 30.0
RATE_DECAY = 0.8  # weight of the past in a measured rate (prefill per token, read per page)


def moving_average(last: float | None, value: float) -> float:
    """The measured rate after one more observation ``value`` (the first: itself)."""
    return value if last is None else RATE_DECAY * last + (1 - RATE_DECAY) * value


class ComputeRate:
    """Prefill seconds per uncached token, measured on the scheduler's prefill steps."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.seconds_per_token = moving_average(self.seconds_per_token, seconds / tokens)


def timeout_s(tokens: int) -> float:
    """SGLang's ``timeout`` deadline for a load of ``tokens`` tokens."""
    return min(TIMEOUT_MAX_S, TIMEOUT_BASE_S + TIMEOUT_PER_KI_TOKEN_S * tokens / 1024)


def wait_s(policy: str, pages: int, tokens: int, compute_s_per_token: float | None,
           load_s_per_page: float | None) -> float:
    """Seconds a request may wait, from the start of its load, for ``pages`` pages holding
    ``tokens`` tokens (see the module docstring)."""
    assert policy in PREFETCH_POLICIES, policy
    if policy == "best_effort" or pages <= 0:
        return 0.0
    if policy == "wait_complete":
        return math.inf
    if policy == "timeout" or compute_s_per_token is None:
        return timeout_s(tokens)
    compute = tokens * compute_s_per_token
    if load_s_per_page is not None and pages * load_s_per_page >= compute:
        return 0.0
    return compute
