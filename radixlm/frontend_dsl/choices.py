"""Rules that turn per-choice token logprobs into a ``select`` decision.

Every rule receives, for each choice, the logprob entries ``[logprob, token_id, text]``
of the choice's own tokens given the prefix. Ties go to the first choice.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

Entries = list[list[Any]]  # [[logprob, token_id, text | None], ...]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax_first(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _logprobs(entries: Entries) -> list[float]:
    return [float(e[0]) for e in entries if e[0] is not None]


def _decision(choice: str, normalized: list[float], input_logprobs: list[Entries],
              output_logprobs: list[Entries], **extra: Any) -> ChoicesDecision:
    """The decision with SGLang's meta_info fields (and a rule's own extras)."""
    return ChoicesDecision(choice, {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": input_logprobs,
        "output_token_logprobs": output_logprobs,
        **extra,
    })


class ChoicesSamplingMethod(abc.ABC):
    """Base of the choice rules; subclasses implement ``__call__``."""

    requires_unconditional_logprobs: bool = False

    @abc.abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[Entries],
        output_token_logprobs: list[Entries],
        unconditional_token_logprobs: list[Entries] | None = None,
    ) -> ChoicesDecision:
        """Pick one of ``choices`` from the logprobs of each prefix + choice."""


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        best = _argmax_first(normalized_prompt_logprobs)
        return _decision(choices[best], normalized_prompt_logprobs, input_token_logprobs,
                         output_token_logprobs)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Keep the choices whose first token is most likely, then compare the second token
    among the survivors, and so on. A choice that has run out of tokens is padded with
    its own mean logprob, so short choices are neither favoured nor ruled out."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        rows = [_logprobs(e) for e in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == top]
            if len(remaining) == 1:
                break
        return _decision(choices[remaining[0]], normalized_prompt_logprobs,
                         input_token_logprobs, output_token_logprobs,
                         greedy_logprob_matrix=matrix)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most from the prefix: the mean over its tokens of
    logprob(token | prefix) - logprob(token | earlier choice tokens only). The first
    token has no unconditional context; its unconditional logprob counts as 0."""

    requires_unconditional_logprobs = True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        if unconditional_token_logprobs is None:
            raise ValueError(
                "unconditional_likelihood_normalized needs unconditional_token_logprobs"
            )
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            base = [0.0 if e[0] is None else float(e[0]) for e in uncond]
            diffs = [c - u for c, u in zip(_logprobs(cond), base)]
            scores.append(_mean(diffs))
        best = _argmax_first(scores)
        return _decision(choices[best], normalized_prompt_logprobs, input_token_logprobs,
                         output_token_logprobs,
                         unconditional_token_logprobs=unconditional_token_logprobs,
                         normalized_unconditional_prompt_logprobs=scores)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
