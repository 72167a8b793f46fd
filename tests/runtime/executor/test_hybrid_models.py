"""The hybrid families (Qwen3-Next dense, Qwen3.5 dense: Gated DeltaNet layers beside gated
attention) against transformers on tiny checkpoints its own classes wrote
(``radixlm.tiny_hybrids``): every row's logits through the runner with states carried across
extends and decodes, and greedy tokens through the Engine (prompts of 20-300 tokens, chunked
prefill shorter than them, two requests at once, a pool that forces retraction), cold and
again from the radix cache's prefixes and recurrent-state snapshots
(test_hybrid_prefix_cache.py tests those further). Features that cannot serve a hybrid yet
are refused by name."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from radixlm import cli
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.hybrid import refuse_hybrid_features, state_pool_slots
from radixlm.runtime.executor.models import build_model, load_model
from radixlm.runtime.executor.models.weights import checkpoint_shapes, plan_load
from radixlm.runtime.model_config import FULL, LINEAR, ModelConfig
from radixlm.tiny_hybrids import GATED_DELTA_HYBRIDS as HYBRIDS
from radixlm.tiny_hybrids import LAYER_TYPES, make_hybrid_model
from radixlm.tiny_model import train_tokenizer
from tests.runtime.executor.hybrid_checks import check_logits_over_steps

# against transformers in float64 (float32 for MoE). Not 1e-4: our float32 logits are
# 1.1e-4 (Qwen3-Next MoE) to 2.3e-4 (Qwen3-Next) off, and that is float32 rounding, not our
# delta rule, whose float32 chunks are as exact as its steps (test_chunk_precision.py):
# against transformers run truly in float64 (its norms, gates and chunked delta rule cast to
# float32 even in a .double() model; with those casts kept float64) Qwen3.5's 1.7e-4 and
# Qwen3-Next's 2.0e-4 stay with our layers' math in float64, and transformers' own float32
# model is 2.8e-4 and 2.1e-4 off. Each random tiny Gated DeltaNet layer amplifies a relative
# perturbation of its input 2-3.4x (attention: 0.8x), and there are three. A state not
# carried or a wrong projection layout moves logits by more than 1.
ATOL = 5e-4
MAX_NEW = 30
LENGTHS = (20, 75, 300)
ENGINE_CONFIGS = {"default": {}, "page4_chunk48": {"page_size": 4, "chunked_prefill_size": 48},
                  # two samples of three short prompts in a pool that cannot hold them all
                  # decoding: requests are retracted, and recompute their whole sequence
                  # from zeros when they come back
                  # (--max-running-requests: more state slots than 128 tokens of KV would buy)
                  "tiny_pool_n2": {"max_total_tokens": 128, "chunked_prefill_size": 16,
                                   "max_running_requests": 8}}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    tok = train_tokenizer()
    return {arch: make_hybrid_model(root / arch, arch, tokenizer=tok) for arch in HYBRIDS}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request, hybrid_dirs):
    """(arch, model dir, prompts, transformers' model, its greedy outputs). For the
    vision-language checkpoint, transformers' causal LM is its language model too."""
    path = hybrid_dirs[request.param]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, prompts, hf, _hf_greedy(hf, prompts)


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def test_config_reads_linear_layers(hybrid):
    _, path, *_ = hybrid
    config = ModelConfig.from_hf(path)
    assert config.layer_types == tuple(LAYER_TYPES) and config.is_hybrid
    assert config.hidden_size == 64
    assert config.kv_layers == 1 and config.kv_layer_index(1) == 0
    assert config.partial_rotary_factor == 0.25


def test_logits_match_transformers(hybrid):
    """Two sequences: extend a prefix, extend past a 64-token chunk from the states left in
    the slots, decode 3 steps; every row equals transformers' logits of the whole sequence.
    The slots start with garbage: a fresh sequence must not read it. The reference is
    transformers' model in float64 (float32 with experts)."""
    arch, path, prompts, hf, _ = hybrid
    seqs = [prompts[1], prompts[2][:150]]
    # transformers' grouped expert matmul has no float64: the MoE models' float32
    ref_model = hf if "moe" in arch else copy.deepcopy(hf).double()
    with torch.no_grad():
        ref = [ref_model(torch.tensor([s])).logits[0].float() for s in seqs]
    check_logits_over_steps(path, seqs, ref, [0, 2, 3], ATOL, arch)


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_greedy_matches_transformers(hybrid, make_engine, config):
    arch, path, prompts, hf, expected = hybrid
    if config.startswith("tiny_pool"):
        prompts = [prompts[0], prompts[1][:24], prompts[2][:28]]
        expected = _hf_greedy(hf, prompts)
    eng = make_engine(model_path=str(path), **ENGINE_CONFIGS[config])
    n = 2 if config.endswith("_n2") else 1
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "n": n}
    want = [e for e in expected for _ in range(n)]
    for attempt in ("cold", "again"):
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        got = [o["output_ids"] for o in outs]
        assert got == want, f"{arch} {config} {attempt}: engine {got} != {want}"
        eng.scheduler.cache.check_accounting()
    info = eng.get_server_info()
    if config.startswith("tiny_pool"):
        assert info["num_preemptions"] > 0, "the pool was meant to retract"


def test_hybrid_refuses_what_cannot_serve_it(hybrid_dirs):
    path = str(hybrid_dirs["qwen3_next"])
    config = ModelConfig.from_hf(path)
    args = ServerArgs(model_path=path, device="cpu")
    refuse_hybrid_features(args, config)  # the defaults serve it
    for change, flag in (({"disaggregation_mode": "prefill", "tp_size": 2},
                          "--disaggregation-mode prefill and --tp-size 2"),
                         ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
                         ({"enable_hybrid_swa_memory": True}, "--enable-hybrid-swa-memory"),
                         ({"is_embedding": True}, "--is-embedding")):
        bad = dataclasses.replace(args)
        for key, value in change.items():
            object.__setattr__(bad, key, value)  # skip the cross-field checks of validate
        with pytest.raises(ValueError, match=f"Qwen3NextForCausalLM.*{flag}"):
            refuse_hybrid_features(bad, config)


def test_make_tiny_model_writes_the_hybrids(tmp_path):
    for arch in HYBRIDS:
        assert cli.main(["make-tiny-model", str(tmp_path / arch), "--arch", arch]) == 0
        config = ModelConfig.from_hf(tmp_path / arch)
        assert LINEAR in config.layer_types
        assert config.architectures == ({"qwen3_next": "Qwen3NextForCausalLM",
                                         "qwen3_next_moe": "Qwen3NextForCausalLM",
                                         "qwen3_5": "Qwen3_5ForCausalLM",
                                         "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
                                         "qwen3_5mm": "Qwen3_5ForConditionalGeneration"}[arch],)


def test_state_pool_size():
    """A slot per request row, unless the rows' states would outgrow the KV pool without
    --max-running-requests asking for them."""
    assert state_pool_slots(257, False, 1 << 30, 1 << 10) == 257  # tiny states: every row
    assert state_pool_slots(257, False, 1 << 30, 50 << 20) == 21  # 20 states in 1 GiB
    assert state_pool_slots(257, True, 1 << 30, 50 << 20) == 257  # asked for
    assert state_pool_slots(257, False, 1 << 20, 50 << 20) == 2  # one request at least


def test_scheduler_runs_no_more_requests_than_state_slots(hybrid_dirs, make_engine):
    path = hybrid_dirs["qwen3_5"]
    eng = make_engine(model_path=str(path), max_running_requests=3)
    runner = eng.scheduler.model_runner
    assert runner.request_state_slots == 4 and runner.snapshot_state_slots == 4  # as many
    assert runner.state_pool_size == 8
    assert eng.scheduler.cache.states.size == 8 and eng.scheduler.max_running_requests == 3
    info = eng.get_server_info()
    assert info["state_pool_slots"] == info["free_state_slots"] == 8
    assert info["state_pool_bytes"] == eng.scheduler.model_runner.state_pool.nbytes > 0


def test_released_checkpoint_layouts(hybrid_dirs, tmp_path):
    """What released files carry besides the tiny ones: multi-token-prediction tensors
    (``mtp.``, not loaded), a vision tower (not loaded), and ``full_attention_interval``
    instead of ``layer_types``."""
    src = hybrid_dirs["qwen3_next"]
    mtp = tmp_path / "mtp"
    shutil.copytree(src, mtp)
    tensors = load_file(mtp / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, mtp / "model.safetensors")
    model = build_model(ModelConfig.from_hf(mtp))
    with pytest.raises(ValueError, match=r"unexpected tensors \[model.layers.9.extra.weight\]"):
        plan_load(model, mtp)
    vlm = load_model(ModelConfig.from_hf(hybrid_dirs["qwen3_5mm"]), hybrid_dirs["qwen3_5mm"])
    assert any(n.startswith("model.visual.") for n in checkpoint_shapes(hybrid_dirs["qwen3_5mm"]))
    assert not any("visual" in n for n, _ in vlm.named_parameters())
    config = json.loads((src / "config.json").read_text())
    del config["layer_types"]
    (mtp / "config.json").write_text(json.dumps({**config, "full_attention_interval": 2}))
    assert ModelConfig.from_hf(mtp).layer_types == (LINEAR, FULL, LINEAR, FULL)
