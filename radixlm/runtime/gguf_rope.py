"""A GGUF file's RoPE scaling as config.json's ``rope_scaling``: linear and yarn from its
keys, Phi-3's longrope from ``rope_factors_long/short.weight``, and Llama 3's scaling fitted
back from the divisors llama.cpp's converter stores in ``rope_freqs.weight``
(``llama3_factors`` is that converter's formula, which the fit is checked against)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from radixlm.runtime.gguf_container import GGUFError


class Meta(Protocol):
    """What this module reads of ``gguf_families.Meta``: typed ``{arch}.*`` metadata."""

    arch: str
    where: str

    def raw(self, key: str) -> Any: ...

    def int(self, key: str, default: int | None = None, low: int = 1) -> int | None: ...

    def float(self, key: str, default: float | None = None) -> float | None: ...


def rope_scaling(m: Meta, extra: dict[str, np.ndarray], ctx: int | None,
                 head_dim: int, theta: float) -> dict[str, Any] | None:
    """config.json's ``rope_scaling`` from a GGUF file's ``{arch}.rope.scaling.*`` keys
    and its RoPE tensors (``extra``: ``rope_freqs.weight``, ``rope_factors_long/short``),
    or None for plain RoPE; GGUFError naming the key for a kind radixlm cannot express."""
    kind = m.raw("{arch}.rope.scaling.type")
    factor = m.float("{arch}.rope.scaling.factor")
    if kind == "linear" and factor and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and factor:
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings":
                   m.int("{arch}.rope.scaling.original_context_length", ctx)}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if (value := m.float("{arch}.rope.scaling." + key)) is not None:
                out[name] = value
        return out
    if "rope_factors_long.weight" in extra:
        original = m.int("{arch}.rope.scaling.original_context_length", ctx)
        long = extra["rope_factors_long.weight"]
        out = {"rope_type": "longrope", "factor": (ctx or original) / original,
               "long_factor": _decimals(long),
               "short_factor": _decimals(extra.get("rope_factors_short.weight", long)),
               "original_max_position_embeddings": original}
        attn = m.float("{arch}.rope.scaling.attn_factor")
        scale = out["factor"]
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if attn is not None and abs(attn - default) > 1e-5:  # else transformers' own
            out["attention_factor"] = attn
        return out
    if "rope_freqs.weight" in extra:
        return _llama3_rope(extra["rope_freqs.weight"], head_dim, theta, m.where)
    if kind not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"{m.where}: {m.arch}.rope.scaling.type {kind!r} is not supported")
    return None


def _decimals(values: np.ndarray) -> list[float]:
    """float32 values as their shortest decimals (1.1, not 1.100000023841858)."""
    return [float(str(v)) for v in values.astype(np.float32)]


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                   original: int) -> np.ndarray:
    """The per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter writes
    them into ``rope_freqs.weight``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, mid))


def _llama3_rope(factors: np.ndarray, head_dim: int, theta: float, where: str
                 ) -> dict[str, Any] | None:
    """Llama 3's rope_scaling recovered from the divisors llama.cpp stores: ``factor`` is the
    largest; the smooth band between gives ``original / (high - low)`` and ``low / (high -
    low)``, and with Llama 3's ``low_freq_factor`` 1 the rest. Checked by recomputing."""
    f = factors.astype(np.float64)
    if f.shape != (head_dim // 2,):
        raise GGUFError(f"{where}: rope_freqs.weight has {f.size} values, expected "
                        f"{head_dim // 2} (half the head dimension)")
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    low, high, original = 1.0, 4.0, 8192  # Llama 3.1's, used when the band is too thin
    if band.sum() >= 2:
        s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)  # s = a / wavelen - b
        a, nb = np.polyfit(1 / wavelen[band], s, 1)
        high = low - 1 / nb
        original = int(round(a * (high - low)))
        high = float(round(high, 4))
    expect = llama3_factors(head_dim, theta, factor, low, high, original)
    if not np.allclose(expect, f, rtol=1e-4, atol=1e-4):
        raise GGUFError(f"{where}: rope_freqs.weight is not a Llama 3 RoPE scaling radixlm "
                        "can express")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}
