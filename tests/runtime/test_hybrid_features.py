"""Everything beside the KV pool on a hybrid model (issue 58, part 5), on tiny Qwen3.5 (Gated
DeltaNet) and Bamba (Mamba2) checkpoints: constrained decoding (sampled outputs valid; greedy
with jump-forward equal to transformers driven by the same grammar and the same jumps, cold
and from a cached prefix's state), n = 2, logprobs against transformers', KV events that
rebuild the radix tree, ``--dp-size 2`` equal to one replica, a forced tool call through the
OpenAI route, and the features a hybrid cannot serve refused by name at start-up."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlm import cli
from radixlm.radix_cache.kv_event_subscriber import ReplicaStream
from radixlm.radix_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixlm.radix_cache.prefix_index import PrefixIndex
from radixlm.runtime.constrained import (
    allocate_token_bitmask,
    allowed_ids,
    canonical_spec,
    create_grammar_backend,
)
from radixlm.runtime.constrained.jump_forward import canonical_jump
from radixlm.runtime.entrypoints.engine.engine import Engine
from radixlm.tiny_hybrids import make_hybrid_model
from radixlm.tiny_model import train_tokenizer
from tests.runtime.constrained.test_constrained_engine import LONG_KEYS_SCHEMA
from tests.runtime.entrypoints.function_call.test_tools_served import SCHEMAS, TOOLS, USER
from tests.runtime.entrypoints.function_call.tools_model import tools_model_dir
from tests.runtime.managers.test_kv_event_publisher import (
    Dropping,
    config,
    tree_blocks,
    wait_until,
)

ARCHS = ("qwen3_5", "bamba")  # a Gated DeltaNet family, a Mamba2 one
# bounded fields: random weights finish such an object within MAX_NEW tokens
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
    "level": {"type": "integer", "minimum": 1, "maximum": 99},
    "color": {"enum": ["red", "green"]}}, "required": ["name", "ok", "level", "color"]}
REGEX = r"[A-Z]{2}-\d{3}( (yes|no))?"
MAX_NEW = 120
# our float32 logits are within 2.5e-4 of transformers' (test_hybrid_models.py says why not
# 1e-4); a log-softmax adds the log-sum-exp's error to it
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_features")
    tok = train_tokenizer()
    return {arch: make_hybrid_model(root / arch, arch, tokenizer=tok) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def eng(arch, model_dirs, make_module_engine):
    return make_module_engine(model_path=str(model_dirs[arch]), page_size=4,
                              max_total_tokens=4096, random_seed=0)


@pytest.fixture(scope="module")
def hf(arch, model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sampled_constrained_outputs_are_valid(eng):
    params = [{"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": s, kind: spec}
              for s in range(3) for kind, spec in (("json_schema", json.dumps(SCHEMA)),
                                                   ("regex", REGEX))]
    outs = eng.generate(["Record:"] * len(params), params)
    for p, out in zip(params, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        if "regex" in p:
            assert re.fullmatch(REGEX, out["text"]), out["text"]
        else:
            jsonschema.validate(json.loads(out["text"]), SCHEMA)


def _hand_constrained_greedy(hf, eng, backend, kind: str, spec, prompt: list[int],
                             max_new: int) -> list[int]:
    """Greedy tokens of transformers' model under ``spec``, jumping forward as the engine
    does (``canonical_jump`` after each sampled token)."""
    matcher = backend.compile(kind, canonical_spec(kind, spec)).new_matcher()
    vocab = eng.model_config.vocab_size
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new and not matcher.is_terminated():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            bitmask = allocate_token_bitmask(1, vocab)
            matcher.fill_bitmask(bitmask, 0)
            allowed = torch.tensor(allowed_ids(bitmask[0], vocab))
            tok = int(allowed[logits[allowed].argmax()])
            assert matcher.accept_token(tok)
            out.append(tok)
            forced = "" if matcher.is_terminated() else matcher.forced_string()
            jump = canonical_jump(matcher, eng.tokenizer, [tok], forced)
            if jump is not None:
                del out[len(out) - jump.rollback:]
                out += jump.ids
    return out[:max_new]


def test_constrained_greedy_with_jumps_equals_transformers(eng, hf):
    """The jumped tokens are one extend of the request's state: the tokens after them are
    still transformers' (cold, then again from the cached prompt's state)."""
    args = eng.server_args
    backend = create_grammar_backend(args.grammar_backend, eng.tokenizer,
                                     eng.model_config.vocab_size, eng.model_config.eos_token_ids)
    prompt = _prompt(45, seed=5)
    before = eng.get_server_info()["jump_forward_tokens"]
    for kind, spec in (("json_schema", LONG_KEYS_SCHEMA), ("regex", REGEX)):
        want = _hand_constrained_greedy(hf, eng, backend, kind, spec, prompt, MAX_NEW)
        params = {"max_new_tokens": MAX_NEW, "temperature": 0, kind: spec}
        for attempt in ("cold", "cached"):
            out = eng.generate(input_ids=prompt, sampling_params=params)
            assert out["output_ids"] == want, (kind, attempt, out["text"])
        assert out["meta_info"]["cached_tokens"] >= 40, out["meta_info"]
    assert eng.get_server_info()["jump_forward_tokens"] > before
    eng.scheduler.cache.check_accounting()


def _logprob_error(hf, prompt: list[int], out: dict) -> float:
    """The largest gap between ``out``'s input and output token logprobs and transformers'
    log-softmax over ``prompt`` + its output."""
    ids = prompt + out["output_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    meta = out["meta_info"]
    first = len(prompt) - len(meta["input_token_logprobs"])
    # (logprob, token, index of the token it follows); a first prompt token has none
    rows = [(v, t, first + i - 1) for i, (v, t, _) in enumerate(meta["input_token_logprobs"])]
    rows += [(v, t, len(prompt) - 1 + i)
             for i, (v, t, _) in enumerate(meta["output_token_logprobs"])]
    assert [t for _, t, _ in rows] == ids[first:] and (rows[0][0] is None) == (first == 0)
    return max(abs(v - lp[pos, t].item()) for v, t, pos in rows if pos >= 0)


def test_n2_and_logprobs_match_transformers(eng, hf):
    """n = 2 greedy samples are transformers' greedy tokens twice; two sampled ones differ
    and each token's logprob is transformers' over its own sequence (each sample decodes
    from a state of its own); every prompt token's logprob too, and with the prompt's state
    from the cache the last one's."""
    prompt = _prompt(70, seed=6)
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    outs = eng.generate(input_ids=prompt, sampling_params={**greedy, "n": 2})
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert [o["output_ids"] for o in outs] == [want, want]
    sampled = eng.generate(input_ids=prompt, return_logprob=True, sampling_params={
        **greedy, "temperature": 1.0, "n": 2, "seed": 3})
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]
    for out in sampled:
        assert _logprob_error(hf, prompt, out) < LOGPROB_ATOL
    for start in (0, -1):
        out = eng.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True,
                           logprob_start_len=start)
        meta = out["meta_info"]
        assert out["output_ids"] == want and len(meta["input_token_logprobs"]) == (
            len(prompt) if start == 0 else 1)
        assert _logprob_error(hf, prompt, out) < LOGPROB_ATOL
        if start == -1:
            assert meta["cached_tokens"] > 0, meta  # the prompt's state came from the tree


def test_refused_at_start_up_by_name(arch, model_dirs, tmp_path, capsys):
    path = str(model_dirs[arch])
    for flags, name in (({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
                          "hicache_storage_dir": str(tmp_path)}, "--enable-hierarchical-cache"),
                        ({"enable_hybrid_swa_memory": True}, "--enable-hybrid-swa-memory")):
        with pytest.raises(ValueError, match=f"ForCausalLM.*hybrid.*{name}"):
            Engine(model_path=path, **flags)
    # a hybrid's recurrent state would advance over rejected drafts: NGRAM is refused
    with pytest.raises(ValueError, match="not supported yet for hybrid models"):
        Engine(model_path=path, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="EAGLE is not supported yet"):
        cli.main(["serve", "--model-path", path, "--speculative-algorithm", "EAGLE"])


def test_kv_events_rebuild_the_tree(model_dirs):
    """A subscriber's index equals the tree's K/V blocks after requests, eviction and a
    flush. The tree's match is cut back to a snapshot, so the index (K/V only) bounds the
    cached tokens from above."""
    cfg = config()
    engine = Engine(model_path=str(model_dirs["qwen3_5"]), max_total_tokens=256, page_size=4,
                    random_seed=0, kv_events_config=json.dumps(dataclasses.asdict(cfg)))
    (publisher,) = engine._kv_publishers
    index = PrefixIndex(1, 4)
    kinds: set[type] = set()
    sub = Dropping([ReplicaStream(publisher.endpoint, publisher.replay_endpoint)], index,
                   drop={1}, on_batch=lambda r, s, b: kinds.update(type(e) for e in b.events))
    tree = engine.scheduler.cache.tree
    shared = _prompt(37, seed=9)
    prompts = [shared + _prompt(5, seed=20 + i) for i in range(4)]
    prompts += [_prompt(40, seed=30 + i) for i in range(12)]  # past the pool: eviction
    one = {"max_new_tokens": 6}
    try:
        for ids in prompts[:4]:
            engine.generate(input_ids=ids, sampling_params=one)
        _caught_up(sub, publisher)
        assert index.blocks(0) == tree_blocks(tree)
        probe = prompts[0] + [77]
        meta = engine.generate(input_ids=probe, sampling_params=one)["meta_info"]
        assert 0 < meta["cached_tokens"] <= index.match(probe)[0]
        for ids in prompts[4:]:
            engine.generate(input_ids=ids, sampling_params=one)
        _caught_up(sub, publisher)
        assert index.blocks(0) == tree_blocks(tree)
        engine.scheduler.cache.check_accounting()
        assert engine.flush_cache()
        _caught_up(sub, publisher)
        assert index.blocks(0) == tree_blocks(tree) == set()
        assert {BlockStored, BlockRemoved, AllBlocksCleared} <= kinds
        assert sub.replayed[0] >= 1 and sub.lost == [0]
    finally:
        sub.close()
        engine.shutdown()


def _caught_up(sub: Dropping, publisher) -> None:
    """Every batch the publisher sent so far is in ``sub``'s index (a quiet stream is
    asked for what its last message did not show)."""
    sub.catch_up()
    wait_until(lambda: sub.next_seq[0] == publisher.next_seq, "stream caught up", sub)


def test_two_replicas_equal_one(model_dirs, make_engine):
    path = str(model_dirs["qwen3_5"])
    prompts = [_prompt(n, seed=n) for n in (20, 75, 140, 33)]
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    one = make_engine(model_path=path, max_total_tokens=4096, random_seed=0)
    want = [o["output_ids"] for o in one.generate(input_ids=prompts, sampling_params=greedy)]
    two = make_engine(model_path=path, max_total_tokens=4096, random_seed=0, dp_size=2,
                      cpu_threads=2)
    for attempt in ("cold", "cached"):
        got = [o["output_ids"] for o in two.generate(input_ids=prompts, sampling_params=greedy)]
        assert got == want, attempt


def test_forced_tool_call_through_openai(model_dirs, module_server, tmp_path_factory):
    """tool_choice naming a function: the call's arguments parse and satisfy its schema;
    response_format's JSON schema holds too."""
    path = tools_model_dir(model_dirs["qwen3_5"], tmp_path_factory.mktemp("tools") / "m")
    srv = module_server(["--model-path", str(path), "--max-total-tokens", "4096",
                         "--tool-call-parser", "qwen25", "--log-level", "warning",
                         "--random-seed", "0"], "hybrid_tools")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    for name in ("get_weather", "get_time"):
        choice = {"type": "function", "function": {"name": name}}
        chat = client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                              tool_choice=choice, max_tokens=200, seed=1)
        (call,) = chat.choices[0].message.tool_calls
        assert chat.choices[0].finish_reason == "tool_calls" and call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    chat = client.chat.completions.create(model="default", messages=USER, max_tokens=MAX_NEW,
                                          response_format=fmt, seed=2)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
