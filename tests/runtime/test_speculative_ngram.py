"""--speculative-algorithm NGRAM: greedy outputs equal the outputs without it, token for
token, in each engine configuration it runs in (page sizes, chunked and mixed prefill, the
radix cache on and off, retraction, n > 1, stops); the pool's accounting is exact and no
request holds a slot past its sequence after every step; what is not supported is refused
by name (managers/scheduler/speculative.py).

Random weights do not copy their prompt, so drafts would never be accepted; a model whose
every layer slides over a window does, in effect: after ``P + O + P`` (``O`` its greedy
output after ``P``, ``P`` longer than its layers' receptive field) it writes ``O`` again,
which is what NGRAM drafts there (the tiny Mistral, windows of 24 tokens)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.managers.scheduler.speculative import Speculator
from radixlm.runtime.managers.scheduler.speculative_ngram import NgramIndex
from radixlm.tiny_families import make_family_model
from radixlm.tiny_model import default_tiny_model_path

NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}
GREEDY = {"temperature": 0, "ignore_eos": True}
MAX_NEW = 40
CONFIGS = {
    "page1": {"page_size": 1, "chunked_prefill_size": -1},
    "page4-chunked": {"page_size": 4, "chunked_prefill_size": 16},
    "no-radix": {"page_size": 1, "disable_radix_cache": True},
    # six requests of 70 tokens in 200 slots: one is retracted
    "retract": {"page_size": 1, "max_total_tokens": 200, "chunked_prefill_size": 32},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = Tokenizer.from_file(str(default_tiny_model_path() / "tokenizer.json"))
    return make_family_model(tmp_path_factory.mktemp("spec") / "mistral", "mistral",
                             tokenizer=tok)


def _unique(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1900) for _ in range(n)]


def _ceil(n: int, page: int) -> int:
    return -(-n // page) * page


def _checked(eng):
    """Wrap the engine's scheduler step: after each one the pool's sum holds, the tree is
    sound, and no running request has drafts left, uncomputed tokens or a slot past the
    page of its next token (a rejected draft's page is freed at once)."""
    sched = eng.scheduler
    step, page = sched.step, sched.cache.page_size

    def checked_step():
        outs = step()
        sched.cache.check_accounting(deep=True)
        for r in sched.running:
            assert not r.draft_ids and r.kv_len == r.seq_len - 1, r
            assert r.alloc_len <= _ceil(r.seq_len, page), r
        return outs

    sched.step = checked_step
    return eng


@pytest.fixture(scope="module")
def engines(make_module_engine, model_dir):
    """name -> (engine without drafts, engine with NGRAM), made on first use."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            cfg = {"model_path": str(model_dir), "dtype": "float32", "max_total_tokens": 4096,
                   **CONFIGS[name]}
            made[name] = (_checked(make_module_engine(**cfg)),
                          _checked(make_module_engine(**cfg, **NGRAM)))
        return made[name]

    return get


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    """``P + O + P`` (the model writes ``O`` again after it) and three unique prompts."""
    base, _ = engines("page1")
    first = _unique(80, 0)
    out = base.generate(input_ids=first, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
    return [first + out["output_ids"] + first, _unique(23, 1), _unique(30, 2), _unique(18, 3)]


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_equal_without_drafts(engines, prompts, name):
    base, spec = engines(name)
    params = {**GREEDY, "max_new_tokens": MAX_NEW}
    if name == "retract":
        prompts = [_unique(30, 10 + i) for i in range(6)]
    want = base.generate(input_ids=prompts, sampling_params=params)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    assert _ids(got) == _ids(want)
    assert sum(o["meta_info"]["spec_draft_token_num"] for o in got) > 0
    if name == "retract":
        assert spec.scheduler.stats["num_preemptions"] > 0
        return
    meta = got[0]["meta_info"]
    assert meta["spec_accept_token_num"] > 0 and meta["spec_accept_length"] > 1.5, meta
    assert meta["spec_verify_ct"] < MAX_NEW - 1, meta
    assert "spec_verify_ct" not in want[0]["meta_info"]
    info = spec.scheduler.get_info()
    assert info["spec_accept_length"] > 1 and info["spec_accepted_tokens"] > 0, info
    assert "spec_accept_length" not in base.scheduler.get_info()
    # a request sharing the first one's prompt and output: the tree's KV of it is exact
    again = prompts[0] + want[0]["output_ids"][:17] + [11, 12]
    a = base.generate(input_ids=again, sampling_params=params)
    b = spec.generate(input_ids=again, sampling_params=params)
    assert b["output_ids"] == a["output_ids"]
    if not CONFIGS[name].get("disable_radix_cache"):
        assert b["meta_info"]["cached_tokens"] >= len(prompts[0]), b["meta_info"]


def test_n_greedy_samples_and_max_new_tokens(engines, prompts):
    base, spec = engines("page1")
    prompt = prompts[0]
    for max_new in (1, 2, 7):
        params = {**GREEDY, "max_new_tokens": max_new, "n": 2}
        want = base.generate(input_ids=prompt, sampling_params=params)
        got = spec.generate(input_ids=prompt, sampling_params=params)
        assert _ids(got) == _ids(want) and all(len(o) == max_new for o in _ids(got))


def test_stops_cut_accepted_tokens(engines, prompts):
    """A stop token or string met inside an accepted run of drafts ends the output there."""
    base, spec = engines("page1")
    prompt = prompts[0]
    full = base.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
    token = full["output_ids"][12]
    text = full["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    for extra in ({"stop_token_ids": [token]}, {"stop": [stop]}, {"stop": [stop],
                                                                    "no_stop_trim": True}):
        params = {**GREEDY, "max_new_tokens": 30, **extra}
        want = base.generate(input_ids=prompt, sampling_params=params)
        got = spec.generate(input_ids=prompt, sampling_params=params)
        assert got["output_ids"] == want["output_ids"], extra
        assert got["text"] == want["text"], extra
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        assert want["meta_info"]["finish_reason"]["type"] == "stop", want["meta_info"]


def test_sampled_and_logprob_requests_decode_without_drafts(engines, prompts):
    """Only greedy requests without logprobs draft; the others are the plain path's."""
    base, spec = engines("page1")
    prompt = prompts[0]
    for params, kw in (({"temperature": 0.8, "seed": 3}, {}),
                       ({"temperature": 0}, {"return_logprob": True, "top_logprobs_num": 2}),
                       ({"temperature": 0, "frequency_penalty": 0.5}, {})):
        params = {**params, "ignore_eos": True, "max_new_tokens": 12}
        want = base.generate(input_ids=prompt, sampling_params=params, **kw)
        got = spec.generate(input_ids=prompt, sampling_params=params, **kw)
        assert got["output_ids"] == want["output_ids"], params
        assert got["meta_info"]["spec_draft_token_num"] == 0, got["meta_info"]
        if kw:
            # the cached prefix's K/V came from other forwards (a verification, not a
            # decode step): the same to float32 rounding
            lps = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
            assert lps == pytest.approx([e[0] for e in want["meta_info"]
                                         ["output_token_logprobs"]], abs=1e-4)


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_algorithm": "EAGLE"}, "EAGLE is not supported yet"),
    ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 is not supported yet"),
    ({"speculative_algorithm": "STANDALONE"}, "STANDALONE is not supported yet"),
    ({"speculative_algorithm": "NEXTN"}, "NEXTN is not supported yet"),
    ({"speculative_algorithm": "MEDUSA"}, "must be one of"),
    ({"speculative_num_draft_tokens": 4}, "needs --speculative-algorithm"),
    ({**NGRAM, "speculative_eagle_topk": 4}, "a tree of drafts is not supported yet"),
    ({**NGRAM, "speculative_draft_model_path": "/x"}, "--speculative-draft-model-path"),
    ({**NGRAM, "speculative_num_steps": 3}, r"speculative_num_steps \+ 1"),
    ({**NGRAM, "speculative_num_draft_tokens": 1}, ">= 2"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 3,
      "speculative_ngram_max_match_window_size": 2}, "min_match_window_size"),
    ({**NGRAM, "tp_size": 2}, "tp_size .* not supported yet"),
    ({**NGRAM, "disaggregation_mode": "decode"}, "disaggregation_mode .* not supported yet"),
    ({**NGRAM, "is_embedding": True}, "is_embedding .* not supported yet"),
])
def test_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_cli_flags():
    from radixlm.server_args_cli import FLAG_GROUPS

    assert "speculative_ngram_max_match_window_size" in FLAG_GROUPS["speculative"][1]
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=3,
                      speculative_eagle_topk=1)
    assert args.speculative_num_draft_tokens is None  # derived by SpecConfig, not written


def test_ngram_index_drafts_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # suffix (2, 3) and (5?) : the longest suffix seen before is [2, 3] (3 tokens: 5 2 3
    # never occurred); its latest earlier occurrence ends at 7, so 7 5 2 ... follow
    assert idx.propose(seq, 3) == [7, 5, 2]
    seq += [4]
    assert idx.propose(seq, 2) == []  # 4 never occurred before
    periodic = [8, 6, 8, 6, 8]
    assert NgramIndex(1, 4).propose(periodic, 5) == [6, 8, 6, 8, 6]  # the period repeats
    assert NgramIndex(2, 2).propose([5, 5], 3) == []  # only the suffix itself


def test_greedy_acceptance_rule():
    assert Speculator.accepted([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]
    assert Speculator.accepted([4, 5], [3, 5, 6]) == [3]
    assert Speculator.accepted([4, 5], [4, 5, 6]) == [4, 5, 6]


def test_hybrid_models_refused():
    """A hybrid model's recurrent state would advance over rejected drafts."""
    with pytest.raises(ValueError, match="not supported yet for hybrid models"):
        Speculator.from_args(ServerArgs(**NGRAM), 4096, hybrid=True)
    assert Speculator.from_args(ServerArgs(), 4096, hybrid=True) is None
    spec = Speculator.from_args(ServerArgs(speculative_algorithm="NGRAM"), 4096, hybrid=False)
    assert spec.config.num_drafts == 11  # SGLang: the largest match window, 12 tokens


def test_builtin_tiny_model_unique_prompts(make_engine):
    """The built-in tiny Llama (full attention): drafts are proposed and rejected, and
    the outputs are still the plain path's."""
    cfg = {"dtype": "float32", "page_size": 4, "chunked_prefill_size": 16}
    base, spec = make_engine(**cfg), _checked(make_engine(**cfg, **NGRAM))
    prompts = [_unique(7, 4) * 5, _unique(31, 5), _unique(12, 6)]
    params = {**GREEDY, "max_new_tokens": MAX_NEW}
    want = base.generate(input_ids=prompts, sampling_params=params)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    assert _ids(got) == _ids(want)
    assert sum(o["meta_info"]["spec_draft_token_num"] for o in got) > 0


def test_server_meta_info(make_server, model_dir, prompts, engines):
    """Through the server's processes: the flags, the outputs and SGLang's meta_info."""
    import httpx

    srv = make_server(["--model-path", str(model_dir), "--dtype", "float32", "--cpu-threads",
                       "1", "--speculative-algorithm", "NGRAM",
                       "--speculative-num-draft-tokens", "6"], "spec")
    body = {"input_ids": prompts[0], "sampling_params": {**GREEDY, "max_new_tokens": MAX_NEW}}
    got = httpx.post(srv.url + "/generate", json=body, timeout=120).json()
    base, _ = engines("page1")
    assert got["output_ids"] == base.generate(**body)["output_ids"]
    meta = got["meta_info"]
    assert meta["spec_verify_ct"] < MAX_NEW - 1 and meta["spec_accept_token_num"] > 0, meta
    assert meta["spec_accept_length"] == pytest.approx(MAX_NEW / meta["spec_verify_ct"])
