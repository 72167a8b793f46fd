"""What one decode step of a grammar costs, and the budget it must keep.

A grammar's compile is bounded in the compile worker, but what it costs at each step is
not the compile's cost: ``x7q(a{2600}){2600}`` compiles in a millisecond and then forces
6.76M characters, which xgrammar's ``find_jump_forward_string`` takes seconds (and 600 MB)
to find, at every step, in the scheduler. So a grammar's step is measured twice:

- when it first compiles, in the compile worker (``probe_steps``: its first
  ``PROBE_STEPS`` steps walked as the scheduler would walk them: the mask filled, an
  allowed token accepted, the end checked, the forced text found and jumped over, and all
  rolled back); a step over the budget refuses the spec (HTTP 400);
- at every step in the scheduler (``StepCost`` per row): a row whose step went over the
  budget ends alone with status 400; its batch-mates go on.

The budget is ``--grammar-step-budget-ms``, per row and step: mask + advance + jump-forward,
counted in the CPU time of the thread that runs them (``time.thread_time``: what the grammar
costs, not how busy the machine is; the backends' C++ and Rust run on that thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from radixlm.runtime.constrained.base import Grammar, allocate_token_bitmask
from radixlm.runtime.constrained.jump_forward import canonical_jump

PROBE_STEPS = 8  # steps of a new grammar walked in the compile worker
BUDGET_FLAG = "--grammar-step-budget-ms"
# how many budgets of wall time the scheduler waits for a step's jump-forward searches
# (jump_search.py): CPU time decides the budget; the deadline only stops a search that
# would hold the batch for seconds, with room for a busy machine's descheduling
JUMP_DEADLINE_BUDGETS = 10
T = TypeVar("T")


def jump_deadline_s(budget_ms: float) -> float:
    """The wall seconds a step waits for its jump-forward searches."""
    return budget_ms * JUMP_DEADLINE_BUDGETS / 1e3


def spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (tests' stand-in for a costly grammar)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class StepCost:
    """The CPU seconds one row's grammar took in one step, by operation ("mask", "advance",
    "jump-forward", "rollback")."""

    def __init__(self) -> None:
        self.ops: dict[str, float] = {}

    def add(self, op: str, seconds: float) -> None:
        self.ops[op] = self.ops.get(op, 0.0) + seconds

    def timed(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.add(op, time.thread_time() - start)

    @property
    def total(self) -> float:
        return sum(self.ops.values())

    def over(self, budget_ms: float) -> str | None:
        """A message naming the budget and its flag if this step cost more (0: no budget)."""
        if not budget_ms or self.total * 1e3 <= budget_ms:
            return None
        op, worst = max(self.ops.items(), key=lambda kv: kv[1])
        return (f"the grammar took {self.total * 1e3:.0f} ms in one decode step ({op}: "
                f"{worst * 1e3:.0f} ms), over the per-step budget of {budget_ms:g} ms "
                f"({BUDGET_FLAG})")


def first_text_token(row: torch.Tensor, stop_token_ids: list[int]) -> int | None:
    """The lowest id a filled bitmask row [W] allows that is not a stop token."""
    words = row.tolist()
    for t in stop_token_ids:
        if t // 32 < len(words):
            words[t // 32] &= ~(1 << (t % 32))
    for i, word in enumerate(words):
        word &= 0xFFFFFFFF
        if word:
            return 32 * i + (word & -word).bit_length() - 1
    return None


def probe_steps(grammar: Grammar, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                budget_ms: float, steps: int = PROBE_STEPS, delay_s: float = 0.0) -> None:
    """ValueError naming the budget if one of the grammar's first ``steps`` steps (the
    lowest allowed text token sampled each time, the forced text jumped over) or their
    rollback costs more than ``budget_ms``. ``delay_s``: each step first spins this long,
    counted as mask time (tests reach the budget with it, never with a slow machine)."""
    if not budget_ms:
        return
    matcher, bitmask, accepted = grammar.new_matcher(), allocate_token_bitmask(1, vocab_size), 0
    for _ in range(steps):
        cost = StepCost()
        if delay_s:
            cost.timed("mask", spin, delay_s)
        cost.timed("mask", matcher.fill_bitmask, bitmask, 0)
        token = first_text_token(bitmask[0], stop_token_ids)
        if token is None or not cost.timed("advance", matcher.accept_token, token):
            break
        accepted += 1
        if not cost.timed("advance", matcher.is_terminated):
            forced = cost.timed("jump-forward", matcher.forced_string)
            jump = cost.timed("jump-forward", canonical_jump, matcher, tokenizer, [token],
                              forced)
            accepted += 0 if jump is None else len(jump.ids) - jump.rollback
        _check(cost, budget_ms)
        if matcher.is_terminated():
            break
    cost = StepCost()
    cost.timed("rollback", matcher.rollback, accepted)
    _check(cost, budget_ms)


def _check(cost: StepCost, budget_ms: float) -> None:
    message = cost.over(budget_ms)
    if message is not None:
        raise ValueError(message)
