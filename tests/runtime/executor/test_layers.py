"""The layer library against transformers: RoPE tables of every type (through the
config.json parsing), Gemma's (1 + w) norm, partial rotary, activations, logits."""

from __future__ import annotations

import os

import torch

# transformers imports triton: in a session that starts here, the Triton kernels of later
# modules must still see TRITON_INTERPRET (as every module using them sets it)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import transformers  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm  # noqa: E402

from radixlm.runtime.distributed.layers import Shard  # noqa: E402
from radixlm.runtime.executor.layers.activation import act_and_mul  # noqa: E402
from radixlm.runtime.executor.layers.logits import LogitsProcessor  # noqa: E402
from radixlm.runtime.executor.layers.norm import RMSNorm, ShardedRMSNorm  # noqa: E402
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding, cos_sin_table  # noqa: E402
from radixlm.runtime.model_config import rope_scaling_of, rope_theta_of  # noqa: E402

SIZE = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 8192}
ROPES = {
    "linear": ("LlamaConfig", {"rope_type": "linear", "factor": 4.0}),
    "llama3": ("LlamaConfig", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 1024}),
    "yarn": ("LlamaConfig", {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 2048}),
    "yarn_mscale": ("LlamaConfig", {"rope_type": "yarn", "factor": 8.0, "mscale": 0.7,
                                    "mscale_all_dim": 1.0, "beta_fast": 16,
                                    "original_max_position_embeddings": 1024}),
    "longrope": ("Phi3Config", {"rope_type": "longrope", "factor": 8.0,
                                "original_max_position_embeddings": 1024,
                                "short_factor": [1.0 + i / 16 for i in range(32)],
                                "long_factor": [1.0 + i / 2 for i in range(32)]}),
}


def _hf_cos_sin(config, rope_type: str, positions: torch.Tensor, seq_len=None) -> torch.Tensor:
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_tables_match_transformers(name):
    cls_name, params = ROPES[name]
    config = getattr(transformers, cls_name)(**SIZE, rope_parameters={"rope_theta": 5e5,
                                                                      **params})
    hf = config.to_dict()  # what config.json holds
    theta, scaling = rope_theta_of(hf), rope_scaling_of(hf)
    table = cos_sin_table(theta, 64, scaling, 4096, hf["max_position_embeddings"])
    rope_type = params["rope_type"]
    short = torch.arange(1024)
    torch.testing.assert_close(table[:1024], _hf_cos_sin(config, rope_type, short),
                               atol=1e-6, rtol=0)
    # past the original length (longrope: with the long factors, as transformers' cache of a
    # longer sequence)
    seq_len = 1025 if rope_type == "longrope" else None
    expected = _hf_cos_sin(config, rope_type, torch.arange(1024, 4096), seq_len=seq_len)
    torch.testing.assert_close(table[1024:], expected, atol=1e-5, rtol=0)


def test_partial_rotary_rotates_only_the_first_dims():
    rope = RotaryEmbedding(head_dim=16, rotary_dim=12, theta=1e4, scaling=None, positions=64,
                           max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
    pos = torch.tensor([0, 3, 9, 17, 63])
    q2, k2 = rope(q, k, pos, backend="torch")
    assert torch.equal(q2[..., 12:], q[..., 12:]) and torch.equal(k2[..., 12:], k[..., 12:])
    full = RotaryEmbedding(12, 12, 1e4, None, 64, 64)
    q3, k3 = full(q[..., :12].contiguous(), k[..., :12].contiguous(), pos, backend="torch")
    torch.testing.assert_close(q2[..., :12], q3)
    torch.testing.assert_close(k2[..., :12], k3)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RotaryEmbedding(16, 7, 1e4, None, 8, 8)


def test_gemma_norm_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen)
    ours, theirs = RMSNorm(32, 1e-6, offset=1.0), Gemma2RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32, generator=gen) * 0.3)
        theirs.weight.copy_(ours.weight)
    assert torch.equal(ours(x, backend="torch"), theirs(x))
    out, res = ours(x, x * 0.5, backend="torch")
    assert torch.equal(res, x * 1.5) and torch.equal(out, theirs(x * 1.5))


def test_activations_and_logits():
    x = torch.randn(3, 8)
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(act_and_mul("gelu_pytorch_tanh")(x), expected)
    with pytest.raises(ValueError, match="unsupported hidden activation 'relu2'"):
        act_and_mul("relu2")
    head = torch.nn.Linear(8, 5, bias=False)
    logits = LogitsProcessor(scaling=2.0, soft_cap=3.0)(head, x)
    torch.testing.assert_close(logits, torch.tanh(head(x) / 2.0 / 3.0) * 3.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        LogitsProcessor(soft_cap=0.0)


def test_sharded_norm_counts_replicated_heads_once():
    """One KV head over two ranks: both hold all of it, the all-reduced squares are
    divided by the two copies, and the norm equals the unsharded one."""

    class TwoReplicas:  # both ranks hold the same rows: the all-reduce doubles them
        size = 2

        def all_reduce(self, x):
            return x * 2

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen)
    sharded = ShardedRMSNorm(16, Shard(0, 0, 16, 16), 1e-6, TwoReplicas())
    plain = RMSNorm(16, 1e-6)
    with torch.no_grad():
        sharded.weight.copy_(torch.randn(16, generator=gen))
        plain.weight.copy_(sharded.weight)
    assert sharded.copies == 2
    torch.testing.assert_close(sharded(x), plain(x, backend="torch"))
    assert sharded.checkpoint_layout("m.k_norm")["m.k_norm.weight"].shard.full == 16
