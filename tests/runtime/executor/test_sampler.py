"""The executor's Sampler: the kept per-batch state advanced by the sampled tokens samples
what a state rebuilt from every output id samples; it is rebuilt when a row did not grow by
exactly its token (a jump-forward) or the rows changed; prompt logprobs come from the rows
named."""

from __future__ import annotations

import torch

from radixlm.runtime.executor.sampler import PromptLogprobRows, Sampler, SamplingBatch
from radixlm.runtime.executor.sampling import SamplingBatchInfo, logprobs_of, sample
from radixlm.runtime.executor.sampling_params import SamplingParams

V = 48
PARAMS = [
    SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, min_new_tokens=3),
]


def _batch(outputs: list[list[int]], rids=("a", "b", "c")) -> SamplingBatch:
    return SamplingBatch(rows=list(range(len(outputs))), rids=list(rids), params=PARAMS,
                         output_ids=outputs, prompt_ids=[[1, 2, 3]] * len(outputs),
                         eos_token_ids=[0], top_logprobs_nums=[0] * len(outputs),
                         token_ids_logprobs=[None] * len(outputs), return_logprob=True)


def test_kept_state_samples_as_a_rebuilt_one():
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(V, torch.device("cpu"), seed=3)
    outputs: list[list[int]] = [[5], [], [9, 9]]
    infos = []
    for _ in range(4):
        logits = torch.randn(3, V, generator=gen) * 2
        got = sampler.sample(logits, _batch(outputs))
        infos.append(sampler._kept[1])
        fresh = SamplingBatchInfo.from_params(PARAMS, outputs, V, prompt_ids=[[1, 2, 3]] * 3,
                                              eos_token_ids=[0], top_logprobs_nums=[0] * 3,
                                              token_ids_logprobs=[None] * 3)
        want = sample(logits, fresh).next_token_ids.tolist()
        # greedy rows with penalties and the seeded row draw no unseeded noise
        assert got.next_token_ids == want
        assert all(lp is not None for lp in got.logprobs)
        for out, tok in zip(outputs, got.next_token_ids):
            out.append(tok)
    assert all(info is infos[0] for info in infos)  # advanced, never rebuilt


def test_state_rebuilt_when_a_row_grew_otherwise():
    sampler = Sampler(V, torch.device("cpu"), seed=3)
    outputs: list[list[int]] = [[5], [], [9]]
    got = sampler.sample(torch.randn(3, V), _batch(outputs))
    first = sampler._kept[1]
    for out, tok in zip(outputs, got.next_token_ids):
        out.append(tok)
    outputs[1].append(11)  # a jump-forward appended a forced token
    sampler.sample(torch.randn(3, V), _batch(outputs))
    assert sampler._kept[1] is not first
    second = sampler._kept[1]
    sampler.sample(torch.randn(3, V), _batch(outputs, rids=("a", "x", "c")))  # not grown
    assert sampler._kept[1] is not second


def test_prompt_logprobs_of_the_rows_named():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
    batch = _batch([[]])
    batch.rows, batch.rids, batch.params = [], [], []
    batch.prompt_logprobs = [PromptLogprobRows(2, 1, [4, 8, 15], 2, [16, 23])]
    got = Sampler(V, torch.device("cpu"), seed=0).sample(logits, batch)
    assert got.next_token_ids == []
    lps, top, asked = logprobs_of(logits[1:4], torch.tensor([4, 8, 15]), [2] * 3,
                                  [[16, 23]] * 3)
    p = got.prompt_logprobs[2]
    assert p.logprobs == lps.tolist() and p.top == top and p.asked == asked
