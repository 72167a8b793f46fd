"""SamplingParams validation and the vectorised sampler, against direct float64 oracles."""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.runtime.executor.sampling import (
    SamplingBatchInfo,
    argmax,
    compute_logprobs,
    process_logits,
    row_seed,
    sample,
    sampling_probs,
)
from radixlm.runtime.executor.sampling_params import SamplingParams

V = 64


def make_info(params: list[SamplingParams], outputs=None, **kw) -> SamplingBatchInfo:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatchInfo.from_params(params, outputs, kw.pop("vocab_size", V), **kw)


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.1}, "repetition_penalty"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 201}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"regex": "a+", "json_schema": "{}"}, "json_schema"),
        ({"logit_bias": {"100": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_verify_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).verify(vocab_size=100, context_len=200)


def test_verify_message_names_limit() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5).verify(vocab_size=100)


def test_valid_params_pass() -> None:
    SamplingParams().verify(vocab_size=100)
    SamplingParams().verify(vocab_size=100, context_len=128)
    SamplingParams(
        temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, frequency_penalty=-2.0,
        presence_penalty=2.0, repetition_penalty=2.0, max_new_tokens=0, stop=["x"],
        stop_token_ids=[0, 99], regex="a+", logit_bias={99: -1.0}, n=3,
    ).verify(vocab_size=100, context_len=10)  # fmt: skip


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy


def test_from_dict() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    p = SamplingParams.from_dict(
        {"stop": "END", "json_schema": {"type": "object"}, "logit_bias": {"5": 2}}
    )
    assert p.stop == ["END"]
    assert json.loads(p.json_schema) == {"type": "object"}
    assert p.logit_bias == {5: 2.0}
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"seed": 7}).seed == 7
    with pytest.raises(ValueError, match="'bogus'.*valid fields.*temperature"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"x": 1}})


def test_replace_copies() -> None:
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    q = p.replace(temperature=0.5)
    q.stop.append("b")
    assert p.stop == ["a"] and q.temperature == 0.5 and p.temperature == 1.0
    assert p.clone() == p


# ---------------------------------------------------------------- direct oracles


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Renormalised float64 distribution after temperature/top-k/top-p/min-p."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = sorted(range(len(probs)), key=lambda t: -probs[t].item())
    mass = 0.0
    for rank, tok in enumerate(order):
        if p.top_k > 0 and rank >= p.top_k:
            keep[tok] = False
        if p.top_p < 1 and mass > p.top_p:
            keep[tok] = False
        mass += probs[tok].item()
    keep &= probs >= p.min_p * probs.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def ref_penalised(row, p: SamplingParams, prompt: list[int], output: list[int]):
    out = row.double().clone()
    for tok in set(prompt) | set(output):
        out[tok] = (
            out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
        )
    for tok in set(output):
        out[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return out


FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=1.3, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.5, top_p=0.95, min_p=0.1),
]


NO_TOP_P = [SamplingParams(top_k=3), SamplingParams(top_k=20, min_p=0.1), SamplingParams()]


@pytest.mark.parametrize("cases", [FILTER_CASES, NO_TOP_P], ids=["sort", "topk"])
def test_filter_support_matches_oracle(cases: list[SamplingParams]) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(cases) + 1, V, generator=gen) * 3
    info = make_info([*cases, SamplingParams(temperature=0.0)])
    probs = sampling_probs(process_logits(logits, info), info)
    for i, p in enumerate(cases):
        expected = set(torch.nonzero(ref_probs(logits[i], p)).flatten().tolist())
        assert set(torch.nonzero(probs[i]).flatten().tolist()) == expected, p
    # every drawn token is in the support; the greedy row is the argmax
    for _ in range(50):
        out = sample(logits, info).next_token_ids
        assert all(probs[i, out[i]] > 0 for i in range(len(cases)))
        assert out[-1] == logits[-1].argmax()


@pytest.mark.parametrize("p", FILTER_CASES[:5])
def test_empirical_frequencies(p: SamplingParams) -> None:
    n, vocab = 2000, 12
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    info = make_info([p] * n, vocab_size=vocab, generator=torch.Generator().manual_seed(2))
    tokens = sample(row.expand(n, vocab).contiguous(), info).next_token_ids
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    expected = ref_probs(row, p)
    assert torch.all(freq[expected == 0] == 0)
    assert (freq - expected).abs().max() < 0.04, (freq, expected)


def test_exponential_race_on_skewed_distribution() -> None:
    # p = (0.9, 0.1): a wrong noise law (say uniform: 1/18 for token 1) shows up clearly.
    n = 2000
    logits = torch.tensor([0.9, 0.1]).log().expand(n, 2).contiguous()
    info = make_info(
        [SamplingParams()] * n, vocab_size=2, generator=torch.Generator().manual_seed(6)
    )
    freq = sample(logits, info).next_token_ids.double().mean().item()
    assert abs(freq - 0.1) < 5 * (0.1 * 0.9 / n) ** 0.5, freq


def test_greedy_only_batch_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.randn(8, V)
    info = make_info([SamplingParams(temperature=0.0)] * 4 + [SamplingParams(top_k=1)] * 4)
    out = sample(logits, info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, out.next_token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_logprobs is None


def test_top_logprobs() -> None:
    logits = torch.randn(3, V)
    ids = torch.tensor([1, 2, 3])
    lp, top = compute_logprobs(logits, ids, [0, 2, 5])
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref[torch.arange(3), ids])
    assert top[0] == ([], [])
    assert top[2][1] == ref[2].topk(5).indices.tolist()
    torch.testing.assert_close(torch.tensor(top[1][0]), ref[1].topk(2).values)


# ---------------------------------------------------------------- penalties, bias, mask


def test_penalties_match_direct_computation() -> None:
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.7, presence_penalty=-2.0),
    ]
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 9, 3, 0)]
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (7, 2, 4, 12)]
    logits = torch.randn(4, V, generator=gen) * 2
    info = make_info(params, outputs, prompt_ids=prompts)
    got = process_logits(logits, info)
    for i, p in enumerate(params):
        ref = ref_penalised(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-5, atol=1e-5)


def test_advance_matches_rebuild() -> None:
    params = [SamplingParams(frequency_penalty=0.4, repetition_penalty=1.3, min_new_tokens=2)] * 2
    prompts, outputs = [[1, 2], [3]], [[4], []]
    info = make_info(params, outputs, prompt_ids=prompts, eos_token_ids=[0])
    info.advance(torch.tensor([5, 4]))
    rebuilt = make_info(params, [[4, 5], [4]], prompt_ids=prompts, eos_token_ids=[0])
    logits = torch.randn(2, V)
    torch.testing.assert_close(process_logits(logits, info), process_logits(logits, rebuilt))


def test_no_penalty_tensors_when_unused() -> None:
    info = make_info([SamplingParams(), SamplingParams(temperature=0.0)])
    assert info.output_counts is None and info.seen_tokens is None and info.logit_bias is None
    assert not (info.need_top_k or info.need_top_p or info.need_min_p or info.need_temperature)


def test_logit_bias_added() -> None:
    logits = torch.zeros(2, V)
    info = make_info([SamplingParams(logit_bias={"7": 5.0, 3: -1.0}), SamplingParams()])
    got = process_logits(logits, info)
    assert got[0, 7] == 5.0 and got[0, 3] == -1.0 and got[0].abs().sum() == 6.0
    assert got[1].abs().sum() == 0


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V / 32)] int32 bitmask (bit j of word i = token 32 i + j)."""
    width = (mask.shape[1] + 31) // 32
    padded = torch.zeros(mask.shape[0], width * 32, dtype=torch.int64)
    padded[:, : mask.shape[1]] = mask.long()
    words = (padded.view(mask.shape[0], width, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_token_bitmask_hook() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=gen)
    mask = torch.rand(6, V, generator=gen) < 0.3
    mask[:, 0] = True
    params = [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=2.0)] * 4
    info = make_info(params, token_bitmask=pack_bits(mask))
    greedy_ref = logits.masked_fill(~mask, float("-inf")).argmax(-1)
    for _ in range(200):
        out = sample(logits, info).next_token_ids
        assert bool(mask[torch.arange(6), out].all())
        assert torch.equal(out[:2], greedy_ref[:2])


def test_min_new_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, V)
    logits[:, 0] = 100.0  # eos
    logits[:, 9] = 50.0  # a stop token id
    params = [SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[9])] * 2
    info = make_info(params, [[1, 1], [1, 1, 1]], eos_token_ids=[0])
    out = sample(logits, info).next_token_ids.tolist()
    assert out[0] not in (0, 9) and out[1] == 0
    info.advance(torch.tensor([5, 0]))
    assert sample(logits, info).next_token_ids.tolist() == [0, 0]


# ---------------------------------------------------------------- seeds


def _seeded_tokens(batch_rows: list[str], rows: dict, steps: int) -> list[int]:
    """Tokens of row 'A' over `steps` steps when it runs with the given neighbours."""
    tokens = []
    for step in range(steps):
        params = [rows[name][0] for name in batch_rows]
        logits = torch.stack([rows[name][1] for name in batch_rows])
        outputs = [[1] * (step if name == "A" else 3 + step) for name in batch_rows]
        info = make_info(params, outputs, generator=torch.Generator().manual_seed(step))
        tokens.append(sample(logits, info).next_token_ids[batch_rows.index("A")].item())
    return tokens


def test_seed_independent_of_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = {
        "A": (SamplingParams(seed=1234, top_p=0.95), torch.randn(V, generator=gen)),
        "B": (SamplingParams(temperature=0.0), torch.randn(V, generator=gen)),
        "C": (SamplingParams(top_k=3, seed=99), torch.randn(V, generator=gen)),
        "D": (SamplingParams(temperature=0.5), torch.randn(V, generator=gen)),
    }
    alone = _seeded_tokens(["A"], rows, 12)
    assert _seeded_tokens(["B", "A", "C"], rows, 12) == alone
    assert _seeded_tokens(["A", "D"], rows, 12) == alone
    assert len(set(alone)) > 1  # the step is part of the seed


def test_different_seeds_differ() -> None:
    logits = torch.zeros(2, 1000)  # uniform: two seeds agreeing 10 times is ~1e-30
    tokens = []
    for step in range(10):
        info = make_info([SamplingParams(seed=1), SamplingParams(seed=2)], [[0] * step] * 2,
                         vocab_size=1000)  # fmt: skip
        tokens.append(sample(logits, info).next_token_ids.tolist())
    assert any(a != b for a, b in tokens)
    assert row_seed(1, 0) != row_seed(1, 1) != row_seed(2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_matches_alone() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=gen).cuda()
    params = [
        SamplingParams(seed=3, top_p=0.9, min_new_tokens=2, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias={1: 3.0}, repetition_penalty=1.2),
        SamplingParams(top_k=5),
    ]
    kw = {"prompt_ids": [[1, 2]] * 3, "eos_token_ids": [0], "device": "cuda"}
    mask = pack_bits(torch.ones(3, V, dtype=torch.bool)).cuda()
    info = make_info(params, [[4, 4]] * 3, token_bitmask=mask, top_logprobs_nums=[2, 0, 1], **kw)
    out = sample(logits, info)
    assert out.next_token_ids.is_cuda and len(out.top_logprobs[0][0]) == 2
    kw["prompt_ids"] = kw["prompt_ids"][:1]
    alone = sample(logits[:1], make_info(params[:1], [[4, 4]], **kw))
    assert alone.next_token_ids[0] == out.next_token_ids[0]


def test_logprobs_only_when_asked() -> None:
    """No row wants logprobs: no log_softmax over the vocabulary, the same tokens."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, V, generator=gen)
    params = [SamplingParams(seed=i, temperature=0.8) for i in range(4)]
    with_lp = sample(logits, make_info(params))
    without = sample(logits, make_info(params, need_logprobs=False))
    assert without.logprobs is None and without.top_logprobs is None
    assert torch.equal(with_lp.next_token_ids, without.next_token_ids)
    ref = torch.log_softmax(logits, -1).gather(-1, with_lp.next_token_ids[:, None])[:, 0]
    assert torch.allclose(with_lp.logprobs, ref)
    # a row asking for top logprobs switches them back on
    asked = sample(logits, make_info(params, need_logprobs=False, top_logprobs_nums=[0, 2, 0, 0]))
    assert asked.logprobs is not None and len(asked.top_logprobs[1][0]) == 2


def test_advanced_state_equals_a_rebuilt_one() -> None:
    """Keeping the batch's sampling state across steps (advance) samples exactly what
    rebuilding it from every output id does: penalties, seeds, min_new_tokens."""
    gen = torch.Generator().manual_seed(5)
    params = [SamplingParams(seed=1, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(seed=2, repetition_penalty=1.3, min_new_tokens=3),
              SamplingParams(temperature=0.0, frequency_penalty=1.5)]
    prompts = [[1, 2, 3], [4, 5], [6]]
    kw = {"prompt_ids": prompts, "eos_token_ids": [0]}
    rebuilt_out: list[list[int]] = [[], [], []]
    kept_out: list[list[int]] = [[], [], []]
    kept = make_info(params, kept_out, **kw)
    for _ in range(12):
        logits = torch.randn(3, V, generator=gen)
        a = sample(logits, make_info(params, rebuilt_out, **kw)).next_token_ids
        b = sample(logits, kept).next_token_ids
        assert torch.equal(a, b)
        for row, t in enumerate(a.tolist()):
            rebuilt_out[row].append(t)
            kept_out[row].append(t)
        kept.advance(b)
    assert rebuilt_out == kept_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_maximum(dtype) -> None:
    """The sampler's argmax equals torch.argmax row for row: the first of tied maxima
    (bf16 rounding makes many), NaN counted as the maximum, -inf and constant rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3001, generator=g).to(dtype)
    x[1, [10, 20, 30]] = 50.0
    x[2, [5, 9]] = float("nan")
    x[3] = 1.0
    x[4] = float("-inf")
    x[5, [0, 3000]] = float("inf")
    x[6:] = (x[6:] * 4).round()  # many ties per row
    first = [r.isnan() if r.isnan().any() else r == r.max() for r in x.float()]
    want = torch.tensor([int(hit.nonzero()[0, 0]) for hit in first])
    assert torch.equal(argmax(x), want)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
