"""Checks on a compiled grammar before any request uses it.

``check_matches_something``: the initial mask allows some text, or the grammar accepts the
empty string; otherwise the grammar matches no string (``[^\\x00-\\U0010FFFF]``) and its
request is a 400 rather than a sampled token the grammar then refuses.
``probe`` (run in the compile worker, where memory and time are bounded): that check, the
jump-forward string of the initial state, and the cost of the grammar's first decode steps
against ``--grammar-step-budget-ms`` (step_budget.py).
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm.runtime.constrained.base import Grammar, Matcher, allocate_token_bitmask
from radixlm.runtime.constrained.step_budget import StepCost, first_text_token, probe_steps


def allows_text(row: torch.Tensor, stop_token_ids: list[int]) -> bool:
    """Whether a filled bitmask row [W] allows some token that is not a stop token."""
    return first_text_token(row, stop_token_ids) is not None


def allows_nothing(matcher: Matcher, row: torch.Tensor, stop_token_ids: list[int]) -> bool:
    """Whether a matcher whose mask is ``row`` can neither produce text nor end here."""
    return not allows_text(row, stop_token_ids) and not matcher.is_accepting()


def check_matches_something(grammar: Grammar, kind: str, vocab_size: int,
                            stop_token_ids: list[int]) -> Matcher:
    """ValueError if the grammar matches no string; returns the matcher it tried."""
    matcher = grammar.new_matcher()
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    if allows_nothing(matcher, bitmask[0], stop_token_ids):
        name = "JSON schema" if kind == "json_schema" else kind
        raise ValueError(f"the {name} matches no string: no token can start its output")
    return matcher


def probe(grammar: Grammar, kind: str, vocab_size: int, stop_token_ids: list[int],
          tokenizer: Any = None, step_budget_ms: float = 0.0, step_delay_s: float = 0.0
          ) -> None:
    """check_matches_something, then the initial jump-forward string (which a grammar with
    no finite match makes unbounded: run this where memory is limited), then the first
    decode steps' cost (``probe_steps``; with a tokenizer and a budget). ValueError naming
    what failed."""
    matcher = check_matches_something(grammar, kind, vocab_size, stop_token_ids)
    cost = StepCost()
    cost.timed("jump-forward", matcher.forced_string)
    message = cost.over(step_budget_ms)
    if message is not None:
        raise ValueError(message)
    if tokenizer is not None:
        probe_steps(grammar, tokenizer, vocab_size, stop_token_ids, step_budget_ms,
                    delay_s=step_delay_s)
