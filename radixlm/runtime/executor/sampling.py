"""Turn a batch's last-position logits into next tokens, vectorised over the batch.

Order of operations for a row (each step is skipped for the whole batch when no row
needs it):

    token_bitmask -> logit_bias -> repetition penalty -> frequency/presence penalties
    -> min_new_tokens (stop ids to -inf)                 = processed logits
    greedy rows: argmax(processed logits)
    sampled rows: softmax(processed / temperature) -> top-k & top-p & min-p -> draw

Top-k, top-p and min-p are each computed on the full temperature-scaled distribution
and the kept set is their intersection (SGLang's torch-native sampler). The draw is an
exponential race, ``argmax(probs / E)`` with ``E ~ Exp(1)`` per token, which picks
token ``i`` with probability ``probs[i] / sum(probs)``. A seeded row draws its ``E``
from a generator seeded by ``(seed, step)`` alone, so its tokens do not depend on
which other requests share the batch. Logprobs are of the raw model logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixlm.kernels import cpu_paged
from radixlm.runtime.constrained.base import apply_token_bitmask_
from radixlm.runtime.executor.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_INF = float("inf")
_NEG_INF = float("-inf")
TopLogprobs = list[tuple[list[float], list[int]]]  # per row: (logprobs, token ids)


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    # [B] float32, chosen token under log_softmax(raw logits); None when no row asked
    logprobs: torch.Tensor | None
    top_logprobs: TopLogprobs | None  # None when no row asked for any
    # per row: logprobs of the row's token_ids_logprob ids (None for rows without)
    token_ids_logprobs: list[list[float] | None] | None = None


@dataclass
class SamplingBatchInfo:
    """Per-step sampling tensors of one batch; build with ``from_params``.

    After the step's tokens are appended, ``advance`` updates the penalty counts and
    the min-new-tokens mask in place, so a batch whose membership did not change need
    not be rebuilt. When requests join or leave, build a new one.
    """

    vocab_size: int
    is_greedy: torch.Tensor  # [B] bool
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows
    top_ks: torch.Tensor  # [B] int64; vocab_size where disabled
    top_ps: torch.Tensor  # [B] float32; inf where disabled (so rounding never trims)
    min_ps: torch.Tensor  # [B] float32
    # Which steps any row needs, known on the host so no step costs a device sync.
    all_greedy: bool
    any_greedy: bool
    need_temperature: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int  # largest enabled top_k (vocab_size when none)
    seeds: list[int | None]
    steps: list[int]  # tokens generated so far, per row
    min_new_tokens: list[int]
    min_tokens_stop_ids: list[list[int]]  # eos + stop_token_ids, per row
    top_logprobs_nums: list[int]
    need_logprobs: bool = True  # False: no row returns logprobs, skip the log_softmax
    token_ids_logprobs: list[list[int] | None] | None = None  # SGLang's token_ids_logprob
    repetition_penalties: torch.Tensor | None = None  # [B, 1]
    frequency_penalties: torch.Tensor | None = None  # [B, 1]
    presence_penalties: torch.Tensor | None = None  # [B, 1]
    output_counts: torch.Tensor | None = None  # [B, V] float32, counts of output tokens
    seen_tokens: torch.Tensor | None = None  # [B, V] bool, in prompt or output
    logit_bias: torch.Tensor | None = None  # [B, V] float32
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32, bit set = allowed
    generator: torch.Generator | None = None  # unseeded rows; None = torch's default
    # (rows, token ids) set to -inf this step for min_new_tokens; rebuilt by to()/advance()
    _min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False
    )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] = (),
        top_logprobs_nums: Sequence[int] | None = None,
        need_logprobs: bool = True,
        token_ids_logprobs: Sequence[list[int] | None] | None = None,
        token_bitmask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatchInfo:
        """``output_ids[i]`` are row i's generated tokens so far (its step is their
        count); ``prompt_ids`` is needed only when a row has a repetition penalty."""
        assert len(params) == len(output_ids), (len(params), len(output_ids))
        greedy = [p.is_greedy for p in params]
        sampled = [p for p in params if not p.is_greedy]
        # Greedy rows get neutral values so they never switch a filter on.
        temperatures = [1.0 if p.is_greedy else p.temperature for p in params]
        top_ks = [vocab_size if p.is_greedy or p.top_k < 0 else p.top_k for p in params]
        top_ps = [_INF if p.is_greedy or p.top_p >= 1 else p.top_p for p in params]
        info = cls(
            vocab_size=vocab_size,
            is_greedy=torch.tensor(greedy, dtype=torch.bool),
            temperatures=_column(temperatures),
            top_ks=torch.tensor(top_ks, dtype=torch.int64),
            top_ps=_floats(top_ps),
            min_ps=_floats([0.0 if p.is_greedy else p.min_p for p in params]),
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            need_temperature=any(t != 1.0 for t in temperatures),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(p.min_p > 0 for p in sampled),
            max_top_k=max((k for k in top_ks if k < vocab_size), default=vocab_size),
            seeds=[p.seed for p in params],
            steps=[len(ids) for ids in output_ids],
            min_new_tokens=[p.min_new_tokens for p in params],
            min_tokens_stop_ids=[
                list(eos_token_ids) + list(p.stop_token_ids or []) for p in params
            ],
            top_logprobs_nums=list(top_logprobs_nums or [0] * len(params)),
            need_logprobs=need_logprobs or any(top_logprobs_nums or [])
            or any(ids is not None for ids in token_ids_logprobs or []),
            token_ids_logprobs=list(token_ids_logprobs) if token_ids_logprobs else None,
            token_bitmask=token_bitmask,
            generator=generator,
        )
        info._init_penalties(params, output_ids, prompt_ids, device)
        info.logit_bias = _bias_tensor(params, vocab_size, device)
        return info.to(device)

    def _init_penalties(
        self,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]] | None,
        device: torch.device | str,
    ) -> None:
        if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
            self.frequency_penalties = _column([p.frequency_penalty for p in params])
            self.presence_penalties = _column([p.presence_penalty for p in params])
            self.output_counts = token_counts(output_ids, self.vocab_size, device)
        if any(p.repetition_penalty != 1 for p in params):
            assert prompt_ids is not None, "repetition_penalty needs prompt_ids"
            self.repetition_penalties = _column([p.repetition_penalty for p in params])
            self.seen_tokens = (token_counts(prompt_ids, self.vocab_size, device) > 0) | (
                token_counts(output_ids, self.vocab_size, device) > 0
            )

    def to(self, device: torch.device | str) -> SamplingBatchInfo:
        for name in (
            "is_greedy", "temperatures", "top_ks", "top_ps", "min_ps", "repetition_penalties",
            "frequency_penalties", "presence_penalties", "output_counts", "seen_tokens",
            "logit_bias", "token_bitmask",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self._min_tokens_index = self._build_min_tokens_index()
        return self

    @property
    def batch_size(self) -> int:
        return len(self.steps)

    @property
    def device(self) -> torch.device:
        return self.is_greedy.device

    def advance(self, next_token_ids: torch.Tensor,
                token_bitmask: torch.Tensor | None = None) -> None:
        """Account for one appended token per row; ``token_bitmask`` is next step's mask."""
        rows = torch.arange(self.batch_size, device=self.device)
        if self.output_counts is not None:
            self.output_counts[rows, next_token_ids] += 1
        if self.seen_tokens is not None:
            self.seen_tokens[rows, next_token_ids] = True
        self.steps = [s + 1 for s in self.steps]
        self.token_bitmask = token_bitmask
        self._min_tokens_index = self._build_min_tokens_index()

    def _build_min_tokens_index(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        blocked = [
            (row, ids)
            for row, (step, min_new, ids) in enumerate(
                zip(self.steps, self.min_new_tokens, self.min_tokens_stop_ids, strict=True)
            )
            if step < min_new and ids
        ]
        if not blocked:
            return None
        rows = [row for row, ids in blocked for _ in ids]
        cols = [i for _, ids in blocked for i in ids]
        return (
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            torch.tensor(cols, dtype=torch.int64, device=self.device),
        )


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[B, V] float32 counts of each token id per row, by one scatter_add."""
    lens = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64, device=device)
    flat = list(itertools.chain.from_iterable(token_ids))
    flat_ids = torch.tensor(flat, dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lens)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(
        0, rows * vocab_size + flat_ids, torch.ones_like(flat_ids, dtype=torch.float32)
    )
    return counts.view(len(token_ids), vocab_size)


def process_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Mask, bias, penalties and min-new-tokens; returns a new [B, V] tensor."""
    if info.token_bitmask is not None:  # grammars: one packed mask for the batch
        logits = logits.clone()
        apply_token_bitmask_(logits, info.token_bitmask)
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.seen_tokens is not None:
        p = info.repetition_penalties
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(info.seen_tokens, penalised, logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits = logits - info.frequency_penalties * counts
        logits = logits - info.presence_penalties * (counts > 0)
    if info._min_tokens_index is not None:
        logits = logits.index_put(info._min_tokens_index, logits.new_tensor(_NEG_INF))
    return logits


def sampling_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Temperature, softmax, then top-k/top-p/min-p: the unnormalised [B, V] probs that
    the sampled rows draw from (greedy rows are left at temperature 1, unfiltered)."""
    if info.need_temperature:
        logits = logits / info.temperatures
    probs = torch.softmax(logits, dim=-1)
    if info.need_top_p:
        probs = _top_k_top_p_sorted(probs, info)
    elif info.need_top_k:
        probs = _top_k_threshold(probs, info)
    if info.need_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * info.min_ps[:, None]
        probs = probs.masked_fill(probs < threshold, 0)
    return probs


def _top_k_top_p_sorted(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # one sort for the batch
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before > info.top_ps[:, None]
    if info.need_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        drop |= ranks[None, :] >= info.top_ks[:, None]
    return torch.empty_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0))


def _top_k_threshold(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    # Without top-p no full sort is needed: keep what reaches each row's k-th value
    # (a tie at the k-th value keeps every tied token).
    top = probs.topk(info.max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top.gather(-1, (info.top_ks.clamp(max=info.max_top_k) - 1)[:, None])
    kth = kth.masked_fill(info.top_ks[:, None] >= info.vocab_size, 0)
    return probs.masked_fill(probs < kth, 0)


def exponential_noise(info: SamplingBatchInfo) -> torch.Tensor:
    """[B, V] Exp(1) noise; seeded rows from their own (seed, step) generator."""
    shape, device = (info.batch_size, info.vocab_size), info.device
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if any(seed is None for seed in info.seeds):
        noise.uniform_(generator=info.generator)
    for row, (seed, step) in enumerate(zip(info.seeds, info.steps, strict=True)):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(row_seed(seed, step))
            noise[row] = torch.empty(shape[1], device=device).uniform_(generator=gen)
    # -log(1 - U) is Exp(1) and several times cheaper than exponential_ on CPU. It can
    # be exactly 0, and a zero-probability token must still lose the race, hence tiny.
    return noise.neg_().log1p_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)


def row_seed(seed: int, step: int) -> int:
    """Mix (seed, step) into a 63-bit generator seed (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first maximal index of each row (NaN counts as the
    maximum). On a CPU the compiled kernel (``csrc/argmax.cpp``: a [32, 32k] float32 batch
    in ~0.3 ms on two threads, against ~1 ms through torch's ``max``); else ``max``'s
    indices, which torch's CPU build vectorises (its argmax took 3x as long)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] > 0 and x.stride(1) == 1 and cpu_paged.available()):
        return torch.ops.radixlm_cpu.argmax_rows(x)
    return x.max(dim=-1).indices


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
    """Next token per row from [B, V] float32 logits of the last positions."""
    processed = process_logits(logits, info)
    if info.all_greedy:
        next_ids = argmax(processed)
    else:
        probs = sampling_probs(processed, info)
        next_ids = argmax(probs / exponential_noise(info))
        if info.any_greedy:
            next_ids = torch.where(info.is_greedy, argmax(processed), next_ids)
    if not info.need_logprobs:  # a full-vocabulary log_softmax per row, only when asked
        return SampleOutput(next_token_ids=next_ids, logprobs=None, top_logprobs=None)
    logprobs, top, asked = logprobs_of(logits, next_ids, info.top_logprobs_nums,
                                       info.token_ids_logprobs)
    return SampleOutput(next_token_ids=next_ids, logprobs=logprobs, top_logprobs=top,
                        token_ids_logprobs=asked)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k_nums: Sequence[int] | None = None
) -> tuple[torch.Tensor, TopLogprobs | None]:
    """Logprob of ``token_ids[i]`` under log_softmax(logits[i]), and the top
    ``top_k_nums[i]`` (logprob, id) of each row when any row asks for them."""
    chosen, top, _ = logprobs_of(logits, token_ids, top_k_nums)
    return chosen, top


def logprobs_of(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    top_k_nums: Sequence[int] | None = None,
    asked_ids: Sequence[list[int] | None] | None = None,
) -> tuple[torch.Tensor, TopLogprobs | None, list[list[float] | None] | None]:
    """``compute_logprobs`` from one log_softmax, plus the logprobs of ``asked_ids[i]``
    (SGLang's ``token_ids_logprob``, in the order given) for the rows that ask."""
    max_k = max(top_k_nums, default=0) if top_k_nums else 0
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # cheaper than logsumexp on CPU
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    top = None
    if max_k > 0:
        values, ids = logprobs.topk(min(max_k, logits.shape[-1]), dim=-1)
        values_list, ids_list = values.tolist(), ids.tolist()
        top = [(v[:k], i[:k]) for v, i, k in zip(values_list, ids_list, top_k_nums,
                                                   strict=True)]
    asked = None
    if asked_ids is not None and any(ids is not None for ids in asked_ids):
        asked = [None if ids is None else logprobs[row, ids].tolist()
                 for row, ids in enumerate(asked_ids)]
    return chosen, top, asked


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]


def _floats(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _bias_tensor(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    entries = [
        (row, token_id, bias)
        for row, p in enumerate(params)
        for token_id, bias in (p.logit_bias or {}).items()
    ]
    if not entries:
        return None
    rows, cols, values = (list(column) for column in zip(*entries, strict=True))
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    bias[rows, cols] = torch.tensor(values, dtype=torch.float32, device=device)
    return bias
