"""A linear-attention layer's decode step with its state updated in place in the state pool
(``csrc/state_step.cpp``): the Gated DeltaNet recurrence, Mamba2's selective state update
and the short causal convolution (of both).

torch's steps (``layers/gated_delta.py``: ``recurrent_gated_delta_rule_step``,
``layers/short_conv.py``: ``causal_conv1d_step``; ``layers/mamba2.py``: ``ssd_step``) take
states gathered out of the pool and give new ones to scatter back, with several passes over
each state matrix between; these read a Gated DeltaNet state in place twice and write it
once, a Mamba2 state once each. Same formulas in float32 (q and k l2-normalised with eps
1e-6, q times ``Dk ** -0.5`` unless given; Mamba2's dt softplus'd after its bias and clamped
to ``dt_limit``); the sums run in another order (a few float32 ulps), exp, log1p and SiLU's
exp are the library's. Built into the library of ``cpu_paged`` (``available()``;
``RADIXLM_CPU_KERNEL=0`` turns it off). """

from __future__ import annotations

import torch

from radixlm.kernels import cpu_paged

DTYPES = (torch.float32, torch.bfloat16)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CPU, float32 or bfloat16, library built."""
    return (all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors)
            and cpu_paged.available())


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
                     scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """One token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv] (one dtype), g, beta [B, Hv];
    ``ssm`` the layer's float32 pool [S, Hv, Dk, Dv], updated in place at ``slots`` [B]
    (distinct); returns out [B, Hv, Dv] in float32."""
    out = torch.empty(v.shape, dtype=torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    torch.ops.radixlm_cpu.gated_delta_step(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), ssm, slots.to(torch.int64).contiguous(), float(scale),
        use_qk_l2norm, out)
    return out


def conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: torch.Tensor, slots: torch.Tensor, activation: str | None = "silu"
                ) -> torch.Tensor:
    """One token per sequence: x [B, C], weight [C, K] (x's dtype), bias [C] or None;
    ``conv`` the layer's pool [S, C, K - 1], shifted in place at ``slots`` [B] (distinct);
    returns the convolution (SiLU'd for "silu" / "swish") [B, C] in x's dtype."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; supported: silu, None")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.radixlm_cpu.conv1d_step(x.contiguous(), weight.to(x.dtype).contiguous(), bias,
                                      conv, slots.to(torch.int64).contiguous(),
                                      activation is not None, out)
    return out


def mamba2_step(xbc: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                dt_bias: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
                dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """One token per sequence: xbc [B, H * P + 2 * G * N] (x | B | C after the conv), dt
    [B, H] (the projection's, before bias and softplus), A_log, D, dt_bias [H]; ``ssm`` the
    layer's float32 pool [S, H, P, N], updated in place at ``slots`` [B] (distinct);
    returns y [B, H, P] with the D skip, in xbc's dtype (``layers/mamba2.py`` ``ssd_step``
    on x, B, C split out of xbc)."""
    out = torch.empty(xbc.shape[0], ssm.shape[1], ssm.shape[2], dtype=xbc.dtype)
    torch.ops.radixlm_cpu.mamba2_step(xbc.contiguous(), dt.to(xbc.dtype).contiguous(), A_log, D,
                                      dt_bias, ssm, slots.to(torch.int64).contiguous(),
                                      float(dt_limit[0]), float(dt_limit[1]), out)
    return out
