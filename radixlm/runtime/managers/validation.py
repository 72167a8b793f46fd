"""Checks of one request before it reaches the scheduler (before any KV is allocated).

Errors a user can cause raise ``ValueError`` naming the field and the limit; the Engine
raises them, the server returns them as HTTP 400.
"""

from __future__ import annotations

from radixlm.runtime.executor.sampling_params import SamplingParams


def validate_request(input_ids: list[int], params: SamplingParams, context_len: int,
                     vocab_size: int, pool_size: int) -> None:
    if not input_ids:
        raise ValueError("the prompt is empty: text or input_ids must hold at least one token")
    bad = next((t for t in input_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise ValueError(f"input_ids holds token id {bad!r}, outside the vocabulary "
                         f"[0, {vocab_size})")
    n = len(input_ids)
    if n >= context_len:
        raise ValueError(f"This model's maximum context length is {context_len} tokens. "
                         f"However, your request has {n} input tokens. Please shorten the "
                         "prompt.")
    params.verify(vocab_size, context_len)
    if n + params.max_new_tokens > context_len:
        raise ValueError(f"max_new_tokens is too large: {params.max_new_tokens}. This model's "
                         f"maximum context length is {context_len} tokens and your request "
                         f"has {n} input tokens ({n} + {params.max_new_tokens} > "
                         f"{context_len})")
    if n + 1 > pool_size:
        raise ValueError(f"the prompt has {n} tokens but the KV cache holds only "
                         f"{pool_size} tokens (max_total_tokens)")
