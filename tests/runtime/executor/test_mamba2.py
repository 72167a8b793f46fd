"""Mamba2 mixer math (``layers/mamba2.py``) against transformers: the chunked scan and the
decode step against ``mamba2_chunk_scan`` / ``mamba2_selective_state_update``, the grouped
gated norms, whole mixers of Nemotron-H, Bamba and Falcon-H1 with their caches; and the
invariants a state pool relies on (a prompt split anywhere, prefill then decode, packing).

Ours runs in float64; transformers' chunked scan casts to float32 inside, so comparisons
with it allow float32 rounding, and ours against ours is held to float64 rounding."""

from __future__ import annotations

import os

import torch

# transformers imports triton: in a session that starts here, the Triton kernels of later
# modules must still see TRITON_INTERPRET (as every module using them sets it)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import AutoConfig, DynamicCache  # noqa: E402
from transformers.models.bamba.modeling_bamba import BambaMixer  # noqa: E402
from transformers.models.falcon_h1.modeling_falcon_h1 import (  # noqa: E402
    FalconH1Mixer,
    FalconH1RMSNormGated,
    compute_mup_vector,
)
from transformers.models.nemotron_h.modeling_nemotron_h import (  # noqa: E402
    NemotronHMamba2Mixer,
    NemotronHRMSNormGated,
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

from radixlm.runtime.executor.layers.gated_delta import (  # noqa: E402
    RecurrentState,
    Snapshots,
    rms_norm_gated,
)
from radixlm.runtime.executor.layers.mamba2 import (  # noqa: E402
    NO_DT_LIMIT,
    Mamba2Spec,
    Mamba2Weights,
    chunk_ssd_scan,
    mamba2_mixer,
    mamba2_mixer_step,
    ssd_step,
)

F64 = torch.float64
H, P, G, N = 4, 8, 2, 16
CHUNK = 16
LIMITS = [NO_DT_LIMIT, (0.05, 0.4)]


def vs_float32(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """ours (float64) against a float32 oracle, relative to the tensor's scale."""
    scale = float(theirs.detach().abs().max())
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=2e-6 * scale)


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    """float64 against float64: the same math in another order."""
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def scan_inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    return {"x": randn(tokens, H, P), "dt": randn(tokens, H) - 2.0,  # softplus ~ 0.02 .. 0.7
            "B": randn(tokens, G, N), "C": randn(tokens, G, N)}


def scan_params(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"A_log": torch.empty(H, dtype=F64).uniform_(0.0, 2.5, generator=gen),
            "D": torch.randn(H, generator=gen, dtype=F64),
            "dt_bias": torch.randn(H, generator=gen, dtype=F64)}


def ssm_state(batch: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, H, P, N, generator=torch.Generator().manual_seed(seed), dtype=F64)


def part(inp: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {name: t[start:end] for name, t in inp.items()}


def chunked(inp, state, lens, limit=NO_DT_LIMIT, snapshots=None):
    """Ours in chunks -> (y, final states, the snapshots' states)."""
    return chunk_ssd_scan(**inp, **scan_params(), initial_state=state, seq_lens=lens,
                          chunk_size=CHUNK, dt_limit=limit, snapshots=snapshots)


def steps(inp, state, limit=NO_DT_LIMIT):
    """Ours one token at a time -> (y [T, H, P], the state after each token)."""
    outs, states = [], []
    for t in range(inp["x"].shape[0]):
        y, state = ssd_step(**part(inp, t, t + 1), **scan_params(), state=state, dt_limit=limit)
        outs.append(y)
        states.append(state)
    return torch.cat(outs), states


# ----------------------------------------------------------------------------- the scan


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("tokens", [1, 17, 70])
def test_chunk_scan_matches_transformers(tokens, limit):
    inp, params, s0 = scan_inputs(tokens), scan_params(), ssm_state(1)
    y, state, _ = chunked(inp, s0, [tokens], limit)
    theirs, theirs_state = mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], -params["A_log"].exp(), inp["B"][None], inp["C"][None],
        CHUNK, D=params["D"], dt_bias=params["dt_bias"], initial_states=s0, dt_softplus=True,
        dt_limit=limit, return_final_states=True)
    vs_float32(y, theirs[0])
    vs_float32(state, theirs_state)


def test_step_matches_transformers_selective_state_update():
    inp, params, s0 = scan_inputs(3), scan_params(), ssm_state(3)  # three sequences
    y, state = ssd_step(**inp, **params, state=s0)
    theirs_state = s0.clone()  # updated in place
    theirs = mamba2_selective_state_update(
        theirs_state, inp["x"], inp["dt"][..., None].expand(-1, -1, P),
        (-params["A_log"].exp())[:, None, None].expand(-1, P, N), inp["B"], inp["C"],
        params["D"][:, None].expand(-1, P), dt_bias=params["dt_bias"][:, None].expand(-1, P),
        dt_softplus=True)
    vs_float32(y, theirs)
    vs_float32(state, theirs_state)


@pytest.mark.parametrize("limit", LIMITS)
def test_chunk_equals_steps_and_passes_through_their_states(limit):
    tokens = 70
    inp, s0 = scan_inputs(tokens), ssm_state(1)
    y, state, _ = chunked(inp, s0, [tokens], limit)
    step_y, step_states = steps(inp, s0, limit)
    exact(y, step_y)
    exact(state, step_states[-1])
    for end in (1, 15, 16, 17, 33, 69):  # a prefix's final state = the state at its end
        _, prefix_state, _ = chunked(part(inp, 0, end), s0, [end], limit)
        exact(prefix_state, step_states[end - 1])


@pytest.mark.parametrize("split", [1, 15, 16, 17, 50, 69])
def test_split_prefill_and_decode_equal_whole(split):
    tokens = 70
    inp, s0 = scan_inputs(tokens), ssm_state(1)
    whole, whole_state, _ = chunked(inp, s0, [tokens])
    head, state, _ = chunked(part(inp, 0, split), s0, [split])
    tail, tail_state, _ = chunked(part(inp, split, tokens), state, [tokens - split])
    exact(torch.cat([head, tail]), whole)
    exact(tail_state, whole_state)
    decoded, step_states = steps(part(inp, split, tokens), state)
    exact(torch.cat([head, decoded]), whole)
    exact(step_states[-1], whole_state)


def test_packed_equals_each_alone():
    lens = [1, 17, 70, 0]
    inp, s0 = scan_inputs(sum(lens)), ssm_state(len(lens))
    y, state, _ = chunked(inp, s0, lens)
    start = 0
    for i, n in enumerate(lens):
        alone, alone_state, _ = chunked(part(inp, start, start + n), s0[i:i + 1], [n])
        exact(y[start:start + n], alone)
        exact(state[i:i + 1], alone_state)
        start += n
    exact(state[3], s0[3])  # the empty sequence's state passes through


@pytest.mark.parametrize("limit", LIMITS)
def test_snapshots_are_the_states_the_run_passes_through(limit):
    lens = [1, 17, 40]
    pairs = [(0, 1), (1, 1), (1, 15), (1, 16), (1, 17), (2, 7), (2, 16), (2, 32), (2, 33),
             (2, 40)]
    inp, s0 = scan_inputs(sum(lens)), ssm_state(len(lens))
    _, final, inside = chunked(inp, s0, lens, limit, Snapshots.of(pairs))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    passed = [steps(part(inp, start, start + n), s0[i:i + 1], limit)[1]
              for i, (start, n) in enumerate(zip(starts, lens))]
    for j, (i, n) in enumerate(pairs):
        exact(inside[j:j + 1], passed[i][n - 1])
    exact(final[2:], passed[2][-1])


def test_float32_compute_and_state():
    inp = {name: t.float() for name, t in scan_inputs(40).items()}
    params = {name: t.float() for name, t in scan_params().items()}
    y, state, _ = chunk_ssd_scan(**inp, **params, initial_state=ssm_state(1).float(),
                              seq_lens=[40], chunk_size=CHUNK)
    assert y.dtype == torch.float32 and state.dtype == torch.float32
    ref, ref_state, _ = chunked(scan_inputs(40), ssm_state(1), [40])
    torch.testing.assert_close(y, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state.float(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- gated norms


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_grouped_gated_norms_match_transformers(norm_before_gate):
    dim = H * P
    weight = torch.randn(dim, dtype=F64)
    x, gate = torch.randn(12, dim, dtype=F64), torch.randn(12, dim, dtype=F64)
    ours = rms_norm_gated(x, gate, weight, 1e-5, group_size=dim // G,
                          norm_before_gate=norm_before_gate)
    falcon = FalconH1RMSNormGated(dim, eps=1e-5, n_groups=G,
                                  norm_before_gate=norm_before_gate).double()
    nemotron = NemotronHRMSNormGated(dim, group_size=dim // G, eps=1e-5).double()
    with torch.no_grad():
        falcon.weight.copy_(weight)
        nemotron.weight.copy_(weight)
    vs_float32(ours, falcon(x, gate))
    if not norm_before_gate:  # Mamba2's own: the gate goes in before the norm
        vs_float32(ours, nemotron(x, gate))


# ----------------------------------------------------------------------------- whole mixers


def nemotron_h():
    config = AutoConfig.for_model(
        "nemotron_h", hidden_size=32, mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N,
        n_groups=G, chunk_size=CHUNK, num_hidden_layers=1, layers_block_type=["mamba"],
        use_conv_bias=True)
    return config, NemotronHMamba2Mixer(config, 0)


def bamba():
    config = AutoConfig.for_model(
        "bamba", hidden_size=16, mamba_expand=2, mamba_n_heads=H, mamba_d_head=P,
        mamba_d_state=N, mamba_n_groups=G, mamba_chunk_size=CHUNK, num_hidden_layers=1,
        attn_layer_indices=[], mamba_conv_bias=True)
    return config, BambaMixer(config, 0)


def falcon_h1(rms_norm: bool):
    config = AutoConfig.for_model(
        "falcon_h1", hidden_size=32, mamba_n_heads=H, mamba_d_head=P, mamba_d_ssm=H * P,
        mamba_d_state=N, mamba_n_groups=G, mamba_chunk_size=CHUNK, num_hidden_layers=1,
        mamba_rms_norm=rms_norm, mamba_norm_before_gate=True, ssm_in_multiplier=0.5,
        ssm_multipliers=[1.5, 0.5, 2.0, 1.0, 0.75])
    mixer = FalconH1Mixer(config, 0)
    mixer.register_buffer("mup_vector", compute_mup_vector(config))  # the model's job
    return config, mixer


FAMILIES = {"nemotron_h": nemotron_h, "bamba": bamba,
            "falcon_h1": lambda: falcon_h1(True), "falcon_h1_no_norm": lambda: falcon_h1(False)}


def spec_and_weights(mixer) -> tuple[Mamba2Spec, Mamba2Weights]:
    norm = mixer.norm if hasattr(mixer.norm, "weight") else None
    spec = Mamba2Spec(mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size,
                      mixer.chunk_size, tuple(mixer.time_step_limit),
                      norm.variance_epsilon if norm is not None else 1e-5,
                      getattr(norm, "norm_before_gate", False), mixer.activation)
    weights = Mamba2Weights(mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
                            mixer.A_log, mixer.D, norm.weight if norm is not None else None)
    return spec, weights


def ours_mixer(mixer, x: torch.Tensor, state: RecurrentState, decode: bool):
    """The mixer through our functions (one sequence, x [T, hidden]); the projections (and
    Falcon-H1's multipliers) are the model file's business."""
    spec, weights = spec_and_weights(mixer)
    proj = mixer.in_proj(x * getattr(mixer, "ssm_in_multiplier", 1.0))
    if hasattr(mixer, "mup_vector"):  # Falcon-H1's per-channel multipliers
        proj = proj * mixer.mup_vector[0, 0]
    gate, xbc, dt = proj.split([spec.intermediate_size, spec.conv_dim, spec.num_heads], dim=-1)
    if decode:
        y, state = mamba2_mixer_step(gate, xbc, dt, weights, spec, state)
    else:
        y, state, _ = mamba2_mixer(gate, xbc, dt, weights, spec, state, [x.shape[0]])
    return mixer.out_proj(y), state


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_mixer_prefill_then_decode_matches_transformers(family):
    config, mixer = FAMILIES[family]()
    torch.manual_seed(4)
    mixer = mixer.double().eval()
    mixer.A_log.copy_(torch.empty(H, dtype=F64).uniform_(0.0, 2.5))
    mixer.D.copy_(torch.randn(H, dtype=F64))
    mixer.dt_bias.copy_(torch.randn(H, dtype=F64) - 1.0)
    if hasattr(mixer.norm, "weight"):
        mixer.norm.weight.copy_(1 + 0.1 * torch.randn(H * P, dtype=F64))
    spec, _ = spec_and_weights(mixer)
    cache = DynamicCache(config=config)
    hidden = mixer.in_proj.in_features
    x = torch.randn(40, hidden, dtype=F64)
    state = RecurrentState.zeros(1, spec.conv_dim, mixer.conv_kernel_size, spec.ssm_shape, F64,
                                 ssm_dtype=F64)
    ours, state = ours_mixer(mixer, x[:37], state, decode=False)
    vs_float32(ours, mixer(x[None, :37], cache=cache)[0])
    for t in range(37, 40):
        ours, state = ours_mixer(mixer, x[t:t + 1], state, decode=True)
        vs_float32(ours, mixer(x[None, t:t + 1], cache=cache)[0])
    exact(state.conv, cache.layers[0].conv_states[0][:, :, 1:])
    vs_float32(state.ssm, cache.layers[0].recurrent_states[0])


@torch.no_grad()
def test_mixer_snapshots_equal_the_prefix_alone():
    _, mixer = nemotron_h()
    mixer = mixer.double()
    spec, weights = spec_and_weights(mixer)
    lens, pairs = [5, 37], [(0, 3), (1, 16), (1, 20)]
    gen = torch.Generator().manual_seed(5)
    proj = torch.randn(sum(lens), mixer.in_proj.out_features, generator=gen, dtype=F64)
    gate, xbc, dt = proj.split([spec.intermediate_size, spec.conv_dim, spec.num_heads], -1)
    state = RecurrentState(
        torch.randn(2, spec.conv_dim, mixer.conv_kernel_size - 1, generator=gen, dtype=F64),
        torch.randn(2, *spec.ssm_shape, generator=gen, dtype=F64))
    _, _, inside = mamba2_mixer(gate, xbc, dt, weights, spec, state, lens, Snapshots.of(pairs))
    for j, (i, n) in enumerate(pairs):
        rows = slice(sum(lens[:i]), sum(lens[:i]) + n)
        alone = RecurrentState(state.conv[i:i + 1], state.ssm[i:i + 1])
        _, prefix, _ = mamba2_mixer(gate[rows], xbc[rows], dt[rows], weights, spec, alone, [n])
        exact(inside.conv[j:j + 1], prefix.conv)
        exact(inside.ssm[j:j + 1], prefix.ssm)
