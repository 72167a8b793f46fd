"""Checks of one request before it reaches the scheduler (before any KV is allocated).

Types were checked at the edge (``entrypoints/protocol.py``); this checks what depends on
the model and the server's limits. Errors a user can cause raise ``ValueError`` naming
the field and the limit; the Engine raises them, the server returns them as HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for on this server."""

    context_len: int
    vocab_size: int
    pool_size: int  # KV slots
    page_size: int = 1
    max_n: int = 64
    max_stop: int = 64  # stop strings, and stop_token_ids, each
    max_stop_len: int = 1024  # characters of one stop string
    max_logit_bias: int = 1024  # entries
    max_top_logprobs: int = 64

    @classmethod
    def from_args(cls, args: ServerArgs, context_len: int, vocab_size: int,
                  pool_size: int) -> RequestLimits:
        return cls(context_len, vocab_size, pool_size, args.page_size, args.max_n,
                   args.max_stop_sequences, args.max_stop_length, args.max_logit_bias,
                   args.max_top_logprobs_num)


def validate_request(input_ids: list[int], params: SamplingParams, limits: RequestLimits,
                     top_logprobs_num: int = 0,
                     token_ids_logprob: list[int] | None = None,
                     build_stop_automata: bool = True) -> None:
    """ValueError naming the first problem. ``build_stop_automata=False`` leaves the
    stop_regex automata (bounded, but not instant) to the caller's worker thread."""
    if not input_ids:
        raise ValueError("the prompt is empty: text or input_ids must hold at least one token")
    n, context_len = len(input_ids), limits.context_len
    if n >= context_len:  # first: the loop below then runs over at most context_len ids
        raise ValueError(f"This model's maximum context length is {context_len} tokens. "
                         f"However, your request has {n} input tokens. Please shorten the "
                         "prompt.")
    vocab = limits.vocab_size
    for t in input_ids:
        if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < vocab):
            raise ValueError(f"input_ids holds token id {t!r}, outside the vocabulary "
                             f"[0, {vocab})")
    params.verify(vocab, context_len, build_stop_automata)
    _check_caps(params, limits, top_logprobs_num)
    _check_token_ids_logprob(token_ids_logprob, limits)
    if n + params.max_new_tokens > context_len:
        raise ValueError(f"max_new_tokens is too large: {params.max_new_tokens}. This model's "
                         f"maximum context length is {context_len} tokens and your request "
                         f"has {n} input tokens ({n} + {params.max_new_tokens} > "
                         f"{context_len})")
    page = limits.page_size
    need = -(-(n + params.max_new_tokens) // page) * page  # whole pages, as allocated
    if need > limits.pool_size:
        raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens "
                         f"({params.max_new_tokens}) needs {need} KV slots but the KV cache "
                         f"holds only {limits.pool_size} (max_total_tokens): it could never "
                         "run; lower max_new_tokens or shorten the prompt")


def _check_caps(params: SamplingParams, limits: RequestLimits, top_logprobs_num: int) -> None:
    def cap(name: str, value: int, limit: int, flag: str) -> None:
        if value > limit:
            raise ValueError(f"{name} is {value}, over the server's limit of {limit} ({flag})")

    cap("n", params.n, limits.max_n, "--max-n")
    cap("the number of stop strings", len(params.stop or []), limits.max_stop,
        "--max-stop-sequences")
    cap("the number of stop_token_ids", len(params.stop_token_ids or []), limits.max_stop,
        "--max-stop-sequences")
    longest = max((len(s) for s in params.stop or []), default=0)
    cap("the length of a stop string", longest, limits.max_stop_len, "--max-stop-length")
    cap("the number of stop_regex patterns", len(params.stop_regex or []), limits.max_stop,
        "--max-stop-sequences")
    longest = max((len(s) for s in params.stop_regex or []), default=0)
    cap("the length of a stop_regex pattern", longest, limits.max_stop_len,
        "--max-stop-length")
    cap("the number of logit_bias entries", len(params.logit_bias or {}),
        limits.max_logit_bias, "--max-logit-bias")
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int):
        raise ValueError(f"top_logprobs_num must be an integer, got {top_logprobs_num!r}")
    if top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
    cap("top_logprobs_num", top_logprobs_num, limits.max_top_logprobs,
        "--max-top-logprobs-num")


def _check_token_ids_logprob(ids: list[int] | None, limits: RequestLimits) -> None:
    """SGLang's ``token_ids_logprob``: a flat list of ids in the vocabulary; radixlm caps
    its length as it caps ``top_logprobs_num`` (each costs a value at every position)."""
    if ids is None:
        return
    if not isinstance(ids, list):
        raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r}")
    for t in ids:
        if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < limits.vocab_size):
            raise ValueError(f"token_ids_logprob holds {t!r}, outside the vocabulary "
                             f"[0, {limits.vocab_size})")
    if len(ids) > limits.max_top_logprobs:
        raise ValueError(f"token_ids_logprob has {len(ids)} ids, over the server's limit of "
                         f"{limits.max_top_logprobs} (--max-top-logprobs-num)")


MAX_CACHE_KEY_CHARS = 256
TENANT_PREFIX = "tenant="  # extra_key / cache_salt parts start "extra_key=" / "cache_salt="


def cache_namespace(extra_key: str | None = None, cache_salt: str | None = None,
                    tenant: str | None = None) -> str | None:
    """The radix-cache namespace of a request: requests share cached KV only within one.
    ``extra_key`` is SGLang's name, ``cache_salt`` vLLM's; either or both may be given.
    ``tenant`` (from the API key, never from the body) always leads a tenant's namespace,
    so no ``extra_key`` / ``cache_salt`` reaches another tenant's, or an untenanted one."""
    parts = [] if tenant is None else [f"{TENANT_PREFIX}{tenant}"]
    for name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if len(value) > MAX_CACHE_KEY_CHARS:
            raise ValueError(f"{name} has {len(value)} characters (limit {MAX_CACHE_KEY_CHARS})")
        parts.append(f"{name}={value}")
    return "\x1f".join(parts) if parts else None


MAX_NAMESPACE_LABELS = 64  # tenants shown one by one in metrics; the rest are "other"


def namespace_label(namespace: str | None) -> str:
    """A metrics label for ``namespace`` that never shows a key or salt: the tenant's name,
    ``default`` (no namespace) or ``salted`` (extra_key / cache_salt without a tenant)."""
    if namespace is None:
        return "default"
    if namespace.startswith(TENANT_PREFIX):
        return "tenant:" + namespace[len(TENANT_PREFIX):].split("\x1f", 1)[0]
    return "salted"


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class PriorityRefused(ValueError):
    """A request set ``priority`` on a server without priority scheduling that was started
    with ``--abort-on-priority-when-disabled`` (SGLang answers 503)."""


def request_priority(priority: int | None, args: ServerArgs) -> int:
    """The priority the scheduler orders a request by (SGLang's rules): without
    ``--enable-priority-scheduling`` a given priority is ignored (0) or refused
    (``PriorityRefused``); with it, a missing one is ``--default-priority-value``, else the
    least urgent value. ValueError if it is not a signed 64-bit integer."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not INT64_MIN <= priority <= INT64_MAX):
        raise ValueError(f"priority must be a signed 64-bit integer between {INT64_MIN} and "
                         f"{INT64_MAX}, got {priority!r}")
    if not args.enable_priority_scheduling:
        if priority is not None and args.abort_on_priority_when_disabled:
            raise PriorityRefused("Using priority is disabled for this server. Please send a "
                                  "new request without a priority.")
        return 0
    if priority is None:
        priority = args.default_priority_value
    if priority is None:
        return INT64_MAX if args.schedule_low_priority_values_first else INT64_MIN
    return priority
