"""What a run's request timings add up to: throughput, latency percentiles, goodput and the
cache hit rate, with the definitions of SGLang's and vLLM's serving benchmarks:

- TTFT: time to the first output token; E2E: time to the end of the stream.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests of one token have none.
- ITL: every gap between consecutive output tokens of every request, pooled.
- percentiles: linear interpolation between the closest ranks (numpy's default).
- goodput: requests that met every SLO, per second of the run; a one-token request's TPOT
  counts as 0 there, as in SGLang. Attainment is over every request sent, failed included.
- cache hit rate: server-reported cached prompt tokens / prompt tokens.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from radixlm.bench.request import RequestOutput

SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}  # e2el: SGLang's key


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linearly interpolated; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds (NaN when there are none)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution:
        ms = [s * 1000 for s in seconds]
        if not ms:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(statistics.fmean(ms), percentile(ms, 50), percentile(ms, 90),
                   percentile(ms, 99), max(ms))


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=200,tpot=50`` (milliseconds) -> {"ttft": 200.0, "tpot": 50.0}."""
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            key, sep, value = part.partition(":")  # SGLang's --goodput KEY:VALUE form
        name = SLO_KEYS.get(key.strip().lower())
        if name is None or not sep:
            raise ValueError(f"--slo {part!r}: expected KEY=MS with KEY in ttft, tpot, e2e")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"--slo {part!r}: the limit must be a positive number of ms")
        slos[name] = ms
    if not slos:
        raise ValueError("--slo is empty: give e.g. ttft=200,tpot=50 (milliseconds)")
    return slos


@dataclass(frozen=True)
class Goodput:
    slos_ms: dict[str, float]
    good: int
    request_goodput: float  # good requests per second
    attainment: float  # good / requests sent
    attainment_by_slo: dict[str, float]


def observed_ms(out: RequestOutput) -> dict[str, float]:
    return {"ttft": out.ttft * 1000, "tpot": (out.tpot or 0.0) * 1000, "e2e": out.latency * 1000}


def goodput(outputs: Sequence[RequestOutput], slos_ms: dict[str, float],
            duration_s: float) -> Goodput:
    met = dict.fromkeys(slos_ms, 0)
    good = 0
    for out in outputs:
        if not out.success:
            continue
        seen = observed_ms(out)
        passed = [k for k, limit in slos_ms.items() if seen[k] <= limit]
        for k in passed:
            met[k] += 1
        good += len(passed) == len(slos_ms)
    n = max(len(outputs), 1)
    return Goodput(dict(slos_ms), good, good / duration_s, good / n,
                   {k: v / n for k, v in met.items()})


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int | None
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    cache_hit_rate: float | None  # None: the server reported no cached_tokens
    goodput: Goodput | None

    def to_record(self) -> dict[str, Any]:
        """Flat keys, named as SGLang's result file names them (mean_ttft_ms, ...)."""
        rec: dict[str, Any] = {k: getattr(self, k) for k in (
            "completed", "failed", "total_input_tokens", "total_output_tokens",
            "total_cached_tokens", "request_throughput", "input_throughput",
            "output_throughput", "total_throughput", "cache_hit_rate")}
        rec["duration"] = self.duration_s
        for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"),
                          ("e2e", "e2e_latency")):
            dist: Distribution = getattr(self, name)
            rec[f"mean_{key}_ms"] = dist.mean
            rec[f"median_{key}_ms"] = dist.p50
            rec[f"p90_{key}_ms"] = dist.p90
            rec[f"p99_{key}_ms"] = dist.p99
            rec[f"max_{key}_ms"] = dist.max
        if self.goodput is not None:
            rec.update({f"goodput_{k}": v for k, v in asdict(self.goodput).items()})
        return rec


def summarize(outputs: Sequence[RequestOutput], duration_s: float,
              slos_ms: dict[str, float] | None = None) -> BenchMetrics:
    if not duration_s > 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [o for o in outputs if o.success]
    n_in = sum(o.prompt_len for o in done)
    n_out = sum(o.output_len for o in done)
    reported = [o for o in done if o.cached_tokens is not None]
    cached = sum(o.cached_tokens or 0 for o in reported) if reported else None
    reported_prompt = sum(o.prompt_len for o in reported)
    hit = None if cached is None or reported_prompt == 0 else cached / reported_prompt
    return BenchMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        total_cached_tokens=cached,
        request_throughput=len(done) / duration_s,
        input_throughput=n_in / duration_s,
        output_throughput=n_out / duration_s,
        total_throughput=(n_in + n_out) / duration_s,
        ttft=Distribution.of([o.ttft for o in done]),
        tpot=Distribution.of([t for o in done if (t := o.tpot) is not None]),
        itl=Distribution.of([g for o in done for g in o.itl]),
        e2e=Distribution.of([o.latency for o in done]),
        cache_hit_rate=hit,
        goodput=None if not slos_ms else goodput(outputs, slos_ms, duration_s),
    )


def format_report(title: str, m: BenchMetrics) -> str:
    lines = [
        f"== {title} ==",
        f"requests {m.completed} ok, {m.failed} failed  duration {m.duration_s:.2f} s",
        f"throughput {m.request_throughput:.2f} req/s  input {m.input_throughput:.1f} tok/s  "
        f"output {m.output_throughput:.1f} tok/s  total {m.total_throughput:.1f} tok/s",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for label, d in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2E", m.e2e)):
        lines.append(f"{label:<12}{d.mean:>10.1f}{d.p50:>10.1f}{d.p90:>10.1f}{d.p99:>10.1f}")
    if m.cache_hit_rate is None:
        lines.append("cache hit rate: not reported by the server")
    else:
        lines.append(f"cache hit rate {100 * m.cache_hit_rate:.1f}% "
                     f"({m.total_cached_tokens} of {m.total_input_tokens} prompt tokens)")
    if m.goodput is not None:
        g = m.goodput
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in g.slos_ms.items())
        per = ", ".join(f"{k} {100 * v:.1f}%" for k, v in g.attainment_by_slo.items())
        lines.append(f"goodput {g.request_goodput:.2f} req/s ({g.good} requests met {slos}; "
                     f"attainment {100 * g.attainment:.1f}%: {per})")
    return "\n".join(lines)
