"""Hybrid models at ``--tp-size 2``: each rank holds half of the linear layers' heads (Gated
DeltaNet's key and value heads, Mamba2's heads and groups), its own state pool of them, and
half of the attention, MLP and experts. Greedy tokens equal transformers' (float32, tiny
checkpoints of ``radixlm.tiny_hybrids``) and one rank's, through chunked prefill and page
size 4; a second request sharing a prefix starts from the cached state on every rank. One
family per checkpoint layout: Qwen3-Next's tensors grouped by key head, Qwen3.5's separate
ones (and its MoE with a shared expert), Nemotron-H's blocks (two Mamba2 groups: one a
rank; relu^2 experts) and Falcon-H1 with one Mamba2 group, as Bamba, Granite 4 and Falcon-H1
are released (both ranks read it; its gated norm, normed before the gate, all-reduces its
squares). A split that does not divide is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlm import tiny_hybrids
from radixlm.runtime.distributed.layers import check_tp_split
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_hybrids import make_hybrid_model
from radixlm.tiny_model import train_tokenizer
from tests.runtime.greedy_oracle import hf_greedy

ARCHES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "falcon_h1_one_group")
MAX_NEW = 12
LENGTHS = (20, 90)
# chunks of 32 tokens over pages of 4: the 90-token prompt's state crosses three extends
ENGINE = {"dtype": "float32", "page_size": 4, "chunked_prefill_size": 32}
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_tp")
    tok = train_tokenizer()
    dirs = {arch: make_hybrid_model(root / arch, arch, tokenizer=tok) for arch in ARCHES[:-1]}
    cls, special = tiny_hybrids.HYBRIDS["falcon_h1"]
    with pytest.MonkeyPatch.context() as mp:  # Falcon-H1's tiny checkpoint with one group
        mp.setitem(tiny_hybrids.HYBRIDS, "falcon_h1", (cls, {**special, "mamba_n_groups": 1}))
        dirs[ARCHES[-1]] = make_hybrid_model(root / ARCHES[-1], "falcon_h1", tokenizer=tok)
    dirs["bamba"] = make_hybrid_model(root / "bamba", "bamba", tokenizer=tok)
    return dirs


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in LENGTHS]


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("arch", ARCHES)
def test_tp2_matches_transformers_and_one_rank(hybrid_dirs, make_engine, arch):
    path = str(hybrid_dirs[arch])
    prompts = _prompts(1)
    expected = hf_greedy(path, prompts, MAX_NEW)
    tp2 = make_engine(model_path=path, tp_size=2, **ENGINE)
    runner = tp2.scheduler.model_runner
    assert runner.state_pool is not None and runner.tp.size == 2
    assert _ids(tp2.generate(input_ids=prompts, sampling_params=GREEDY)) == expected, arch
    tp1 = make_engine(model_path=path, **ENGINE)
    # each rank's recurrent state is of half the heads
    halves = {i: (s.ssm_shape[0] // 2, *s.ssm_shape[1:])
              for i, s in tp1.scheduler.model_runner.model.state_specs().items()}
    assert {i: s.ssm_shape for i, s in runner.model.state_specs().items()} == halves
    assert _ids(tp1.generate(input_ids=prompts, sampling_params=GREEDY)) == expected, arch


def test_tp2_reuses_a_cached_prefix_state(hybrid_dirs, make_engine):
    """A second request sharing 64 tokens of the first reports them cached (the snapshot at
    64, restored on both ranks) and still decodes transformers' tokens."""
    path = str(hybrid_dirs["qwen3_5"])
    first = _prompts(2)[1]
    second = first[:64] + _prompts(3)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in (first, second)]
    eng = make_engine(model_path=path, tp_size=2, **ENGINE)
    assert eng.generate(input_ids=[first], sampling_params=GREEDY)[0]["output_ids"] == want[0]
    out = eng.generate(input_ids=[second], sampling_params=GREEDY)[0]
    assert out["output_ids"] == want[1]
    assert out["meta_info"]["cached_tokens"] == 64, out["meta_info"]
    eng.scheduler.cache.check_accounting()


def test_uneven_linear_heads_refused_by_name(hybrid_dirs):
    """Three ranks split neither the 2 key heads of Qwen3-Next's linear layers nor the 8
    heads and 2 groups of Bamba's Mamba2 mixers: refused before any rank starts. Four
    ranks split Bamba (two a group); one group is shared by any number of ranks."""
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) is not divisible"):
        check_tp_split(ModelConfig.from_hf(str(hybrid_dirs["qwen3_next"])), 3)
    with pytest.raises(ValueError, match=r"mamba_n_heads \(8\) is not divisible.*"
                                         r"mamba_n_groups \(2\) neither divides"):
        check_tp_split(ModelConfig.from_hf(str(hybrid_dirs["bamba"])), 3)
    check_tp_split(ModelConfig.from_hf(str(hybrid_dirs["bamba"])), 4)
    check_tp_split(ModelConfig.from_hf(str(hybrid_dirs["falcon_h1_one_group"])), 4)
