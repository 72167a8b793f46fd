"""Gated DeltaNet math (``layers/gated_delta.py``) against transformers' Qwen3-Next: the short
conv, the chunked and one-step delta rule, the gated norm, a whole linear-attention layer
with its cache; and the invariants a state pool relies on: a prompt split anywhere, a
prefill followed by decode steps, or sequences packed together give the numbers of one run.

Ours runs in float64 (its compute dtype follows float64 inputs); transformers' delta rules
cast to float32 inside, so comparisons with them allow float32 rounding (a few 1e-7 on
values of order 1), and ours against ours is held to float64 rounding."""

from __future__ import annotations

import os

import torch

# transformers imports triton: in a session that starts here, the Triton kernels of later
# modules must still see TRITON_INTERPRET (as every module using them sets it)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import AutoConfig, DynamicCache  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    Qwen3NextGatedDeltaNet,
    Qwen3NextRMSNormGated,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from radixlm.runtime.executor.layers.gated_delta import (  # noqa: E402
    RecurrentState,
    Snapshots,
    chunk_gated_delta_rule,
    gated_delta_gates,
    recurrent_gated_delta_rule_step,
    rms_norm_gated,
)
from radixlm.runtime.executor.layers.short_conv import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_step,
)

F64 = torch.float64
HK, HV, DK, DV = 2, 4, 8, 6  # grouped: each q/k head serves two value heads
CONV_DIM, KERNEL = 10, 4


def vs_float32(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """ours (float64) against a float32 oracle."""
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=2e-6)


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    """float64 against float64: the same math in another order."""
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def delta_inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(tokens, HK, DK, generator=gen, dtype=F64),
            "k": torch.randn(tokens, HK, DK, generator=gen, dtype=F64),
            "v": torch.randn(tokens, HV, DV, generator=gen, dtype=F64),
            "g": -torch.rand(tokens, HV, generator=gen, dtype=F64),  # log decay <= 0
            "beta": torch.rand(tokens, HV, generator=gen, dtype=F64)}


def delta_state(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, HV, DK, DV, generator=torch.Generator().manual_seed(seed),
                       dtype=F64)


def part(inp: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {name: t[start:end] for name, t in inp.items()}


def steps(inp: dict[str, torch.Tensor], state: torch.Tensor):
    """Ours one token at a time -> (out [T, Hv, Dv], the state after each token)."""
    outs, states = [], []
    for t in range(inp["q"].shape[0]):
        out, state = recurrent_gated_delta_rule_step(**part(inp, t, t + 1), state=state)
        outs.append(out)
        states.append(state)
    return torch.cat(outs), states


# ----------------------------------------------------------------------------- short conv


def conv_params(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(CONV_DIM, KERNEL, generator=gen, dtype=F64),
            torch.randn(CONV_DIM, generator=gen, dtype=F64))


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_fresh_sequence_matches_transformers(with_bias):
    weight, bias = conv_params()
    bias = bias if with_bias else None
    x = torch.randn(23, CONV_DIM, dtype=F64)
    fresh = torch.zeros(1, CONV_DIM, KERNEL - 1, dtype=F64)
    out, state, _ = causal_conv1d(x, weight, bias, fresh, [23])
    theirs = causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T
    exact(out, theirs)
    exact(state[0], x[-(KERNEL - 1):].T)


def test_conv_step_matches_transformers_update():
    weight, bias = conv_params()
    history = torch.randn(9, CONV_DIM, dtype=F64)
    x = torch.randn(1, CONV_DIM, dtype=F64)
    theirs_state = history[-KERNEL:].T[None].clone()  # transformers keeps K columns
    theirs = causal_conv1d_update(x.T[None], theirs_state, weight, bias, activation="silu")
    out, state = causal_conv1d_step(x, weight, bias, history[-(KERNEL - 1):].T[None])
    exact(out, theirs[0].T)
    exact(state, theirs_state[:, :, 1:])


@pytest.mark.parametrize("split", [1, 2, 3, 4, 17])
def test_conv_split_equals_whole(split):
    weight, bias = conv_params()
    x = torch.randn(20, CONV_DIM, dtype=F64)
    fresh = torch.zeros(1, CONV_DIM, KERNEL - 1, dtype=F64)
    whole, whole_state, _ = causal_conv1d(x, weight, bias, fresh, [20])
    head, state, _ = causal_conv1d(x[:split], weight, bias, fresh, [split])
    tail, state, _ = causal_conv1d(x[split:], weight, bias, state, [20 - split])
    exact(torch.cat([head, tail]), whole)
    exact(state, whole_state)
    # the last tokens again one decode step at a time
    out, state, _ = causal_conv1d(x[:split], weight, bias, fresh, [split])
    outs = [out]
    for t in range(split, 20):
        out, state = causal_conv1d_step(x[t:t + 1], weight, bias, state)
        outs.append(out)
    exact(torch.cat(outs), whole)
    exact(state, whole_state)


def test_conv_packed_equals_each_alone():
    weight, bias = conv_params()
    lens = [1, 17, 0, 70, 2]  # shorter than K - 1, empty, several chunks
    x = torch.randn(sum(lens), CONV_DIM, dtype=F64)
    states = torch.randn(len(lens), CONV_DIM, KERNEL - 1, dtype=F64)
    packed, packed_states, _ = causal_conv1d(x, weight, bias, states, lens)
    start = 0
    for i, n in enumerate(lens):
        alone, alone_state, _ = causal_conv1d(x[start:start + n], weight, bias,
                                              states[i:i + 1], [n])
        exact(packed[start:start + n], alone)
        exact(packed_states[i:i + 1], alone_state)
        start += n
    exact(packed_states[2], states[2])  # the empty sequence's state passes through


# ----------------------------------------------------------------------------- delta rule


@pytest.mark.parametrize("tokens", [1, 17, 64, 130])
def test_chunk_matches_transformers(tokens):
    inp, s0 = delta_inputs(tokens), delta_state(1)
    out, state, _ = chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=[tokens])
    batched = {name: t[None] for name, t in inp.items()}
    for oracle in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        theirs, theirs_state = oracle(batched["q"], batched["k"], batched["v"], batched["g"],
                                      batched["beta"], initial_state=s0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        vs_float32(out, theirs[0])
        vs_float32(state, theirs_state)


def test_step_matches_transformers_recurrent():
    inp, s0 = delta_inputs(3), delta_state(3)  # three sequences, one token each
    out, state = recurrent_gated_delta_rule_step(**inp, state=s0)
    theirs, theirs_state = torch_recurrent_gated_delta_rule(
        inp["q"][:, None], inp["k"][:, None], inp["v"][:, None], inp["g"][:, None],
        inp["beta"][:, None], initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    vs_float32(out, theirs[:, 0])
    vs_float32(state, theirs_state)


def test_chunk_equals_steps_and_passes_through_their_states():
    tokens = 130
    inp, s0 = delta_inputs(tokens), delta_state(1)
    out, state, _ = chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=[tokens])
    step_out, step_states = steps(inp, s0)
    exact(out, step_out)
    exact(state, step_states[-1])
    for end in (1, 5, 63, 64, 65, 128, 129):  # a prefix's final state = the state at its end
        _, prefix_state, _ = chunk_gated_delta_rule(**part(inp, 0, end), initial_state=s0,
                                                    seq_lens=[end])
        exact(prefix_state, step_states[end - 1])


@pytest.mark.parametrize("split", [1, 63, 64, 65, 100, 129])
def test_split_prefill_and_decode_equal_whole(split):
    tokens = 130
    inp, s0 = delta_inputs(tokens), delta_state(1)
    whole, whole_state, _ = chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=[tokens])
    head, state, _ = chunk_gated_delta_rule(**part(inp, 0, split), initial_state=s0,
                                            seq_lens=[split])
    tail, tail_state, _ = chunk_gated_delta_rule(**part(inp, split, tokens),
                                                 initial_state=state, seq_lens=[tokens - split])
    exact(torch.cat([head, tail]), whole)
    exact(tail_state, whole_state)
    decoded, step_states = steps(part(inp, split, tokens), state)
    exact(torch.cat([head, decoded]), whole)
    exact(step_states[-1], whole_state)


@pytest.mark.parametrize("lens", [[1, 17, 70, 0], [16, 0, 32]])  # padded; whole chunks
def test_packed_equals_each_alone(lens):
    inp, s0 = delta_inputs(sum(lens)), delta_state(len(lens))
    out, state, _ = chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=lens, chunk_size=16)
    start = 0
    for i, n in enumerate(lens):
        alone, alone_state, _ = chunk_gated_delta_rule(**part(inp, start, start + n),
                                                       initial_state=s0[i:i + 1], seq_lens=[n],
                                                       chunk_size=16)
        exact(out[start:start + n], alone)
        exact(state[i:i + 1], alone_state)
        start += n
    empty = lens.index(0)
    exact(state[empty], s0[empty])  # the empty sequence's state passes through


SNAP_LENS = [1, 17, 40]
SNAPS = [(0, 1), (1, 1), (1, 15), (1, 16), (1, 17), (2, 7), (2, 16), (2, 32), (2, 33), (2, 40)]


def test_snapshots_are_the_states_the_run_passes_through():
    """States inside a packed call (chunks of 16: first rows, chunk ends, the row after one,
    the middle, a sequence's end) are those one-token steps pass through, and the conv's are
    those of the prefix alone."""
    inp, s0 = delta_inputs(sum(SNAP_LENS)), delta_state(len(SNAP_LENS))
    snapshots = Snapshots.of(SNAPS)
    _, final, inside = chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=SNAP_LENS,
                                              chunk_size=16, snapshots=snapshots)
    weight, bias = conv_params()
    x = torch.randn(sum(SNAP_LENS), CONV_DIM, dtype=F64)
    conv0 = torch.randn(len(SNAP_LENS), CONV_DIM, KERNEL - 1, dtype=F64)
    _, _, conv_inside = causal_conv1d(x, weight, bias, conv0, SNAP_LENS, snapshots=snapshots)
    starts = [sum(SNAP_LENS[:i]) for i in range(len(SNAP_LENS))]
    passed = [steps(part(inp, start, start + n), s0[i:i + 1])[1]
              for i, (start, n) in enumerate(zip(starts, SNAP_LENS))]
    for j, (i, n) in enumerate(SNAPS):
        exact(inside[j:j + 1], passed[i][n - 1])
        _, conv_prefix, _ = causal_conv1d(x[starts[i]:starts[i] + n], weight, bias,
                                          conv0[i:i + 1], [n])
        exact(conv_inside[j:j + 1], conv_prefix)
    exact(final[2:], passed[2][-1])
    with pytest.raises(AssertionError, match="outside"):
        chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=SNAP_LENS,
                               snapshots=Snapshots.of([(0, 2)]))


def test_float32_compute_and_state():
    inp = {name: t.float() for name, t in delta_inputs(40).items()}
    s0 = delta_state(1).float()
    out, state, _ = chunk_gated_delta_rule(**inp, initial_state=s0, seq_lens=[40])
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    step_out, step_states = steps(inp, s0)
    torch.testing.assert_close(out, step_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, step_states[-1], rtol=1e-5, atol=1e-5)


def test_gated_norm_matches_transformers():
    norm = Qwen3NextRMSNormGated(DV, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, dtype=F64))
    x, gate = torch.randn(12, DV, dtype=F64), torch.randn(12, DV, dtype=F64)
    vs_float32(rms_norm_gated(x, gate, norm.weight, 1e-6), norm(x, gate))


# ----------------------------------------------------------------------------- a whole layer


def tiny_config():
    return AutoConfig.for_model(
        "qwen3_next", hidden_size=32, linear_num_value_heads=HV, linear_num_key_heads=HK,
        linear_key_head_dim=DK, linear_value_head_dim=DV, num_hidden_layers=1,
        layer_types=["linear_attention"])


def tiny_layer(config) -> Qwen3NextGatedDeltaNet:
    torch.manual_seed(3)
    layer = Qwen3NextGatedDeltaNet(config, 0).double().eval()
    with torch.no_grad():
        layer.dt_bias.copy_(torch.randn(HV, dtype=F64))
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(DV, dtype=F64))
    return layer


def ours_layer(layer: Qwen3NextGatedDeltaNet, x: torch.Tensor, state: RecurrentState,
               decode: bool) -> tuple[torch.Tensor, RecurrentState]:
    """The layer through our functions (one sequence, x [T, hidden]); the projections and
    their head order are the model file's business, borrowed here from the module."""
    tokens = x.shape[0]
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x)[None],
                                                          layer.in_proj_ba(x)[None])
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)[0]  # [T, conv_dim]
    weight = layer.conv1d.weight.squeeze(1)
    if decode:
        mixed, conv = causal_conv1d_step(mixed, weight, None, state.conv)
    else:
        mixed, conv, _ = causal_conv1d(mixed, weight, None, state.conv, [tokens])
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(tokens, HK, DK), k.view(tokens, HK, DK), v.view(tokens, HV, DV)
    g, beta = gated_delta_gates(a[0], b[0], layer.A_log, layer.dt_bias)
    if decode:
        core, ssm = recurrent_gated_delta_rule_step(q, k, v, g, beta, state.ssm)
    else:
        core, ssm, _ = chunk_gated_delta_rule(q, k, v, g, beta, state.ssm, [tokens])
    normed = rms_norm_gated(core.reshape(-1, DV), z[0].reshape(-1, DV), layer.norm.weight,
                            layer.norm.variance_epsilon)
    return layer.out_proj(normed.reshape(tokens, HV * DV)), RecurrentState(conv, ssm)


@torch.no_grad()
def test_layer_prefill_then_decode_matches_transformers():
    config = tiny_config()
    layer, cache = tiny_layer(config), DynamicCache(config=config)
    x = torch.randn(73, 32, dtype=F64)
    state = RecurrentState.zeros(1, 2 * HK * DK + HV * DV, KERNEL, (HV, DK, DV), F64,
                                 ssm_dtype=F64)
    ours, state = ours_layer(layer, x[:70], state, decode=False)
    vs_float32(ours, layer(x[None, :70], cache=cache)[0])
    for t in range(70, 73):
        ours, state = ours_layer(layer, x[t:t + 1], state, decode=True)
        vs_float32(ours, layer(x[None, t:t + 1], cache=cache)[0])
    exact(state.conv, cache.layers[0].conv_states[0][:, :, 1:])
    vs_float32(state.ssm, cache.layers[0].recurrent_states[0])

