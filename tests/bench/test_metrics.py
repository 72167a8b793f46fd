"""Percentiles, goodput and the cache hit rate on hand-made request timings, against values
computed by hand; SLO and request-rate parsing; the arrival process."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from radixlm.bench.metrics import goodput, parse_slo, percentile, summarize
from radixlm.bench.request import RequestOutput
from radixlm.bench.serve import arrival_offsets, parse_request_rates


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_equals_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.exponential(1.0, n).tolist()
        for p in (0, 12.5, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def _out(ttft: float, latency: float, n: int, itl: list[float], prompt: int = 100,
         cached: int | None = None, ok: bool = True) -> RequestOutput:
    return RequestOutput(success=ok, ttft=ttft, latency=latency, output_len=n, itl=itl,
                         prompt_len=prompt, cached_tokens=cached, error="" if ok else "x")


# four requests (times in s): TTFT 0.1, 0.2, 0.3, 0.4; 5 output tokens each except the
# third (1 token: no TPOT, no ITL); one failed request
OUTS = [
    _out(0.1, 0.5, 5, [0.1, 0.1, 0.1, 0.1], cached=50),   # TPOT (0.5-0.1)/4 = 0.1
    _out(0.2, 1.0, 5, [0.2, 0.2, 0.2, 0.2], cached=0),    # TPOT 0.2
    _out(0.3, 0.3, 1, [], prompt=200, cached=100),        # TPOT none
    _out(0.4, 0.8, 5, [0.1, 0.1, 0.1, 0.1], cached=30),   # TPOT 0.1
    _out(0.0, 0.0, 0, [], ok=False),
]


def test_summarize_against_hand_computed_values():
    m = summarize(OUTS, duration_s=2.0)
    assert (m.completed, m.failed) == (4, 1)
    assert m.total_input_tokens == 500 and m.total_output_tokens == 16
    assert m.request_throughput == 2.0 and m.output_throughput == 8.0
    assert m.input_throughput == 250.0 and m.total_throughput == 258.0
    # TTFT ms sorted [100, 200, 300, 400]: p50 250, p90 300 + 0.7 * 100, p99 300 + 0.97 * 100
    assert m.ttft.mean == pytest.approx(250.0)
    assert m.ttft.p50 == pytest.approx(250.0)
    assert m.ttft.p90 == pytest.approx(370.0)
    assert m.ttft.p99 == pytest.approx(397.0)
    # TPOT ms [100, 200, 100] -> sorted [100, 100, 200]: p50 100, p90 180, p99 198
    assert m.tpot.mean == pytest.approx(400 / 3)
    assert (m.tpot.p50, m.tpot.p90, m.tpot.p99) == pytest.approx((100.0, 180.0, 198.0))
    # ITL ms pooled: 8 x 100 and 4 x 200 -> p50 100, p90 at rank 9.9 -> 200
    assert m.itl.mean == pytest.approx(1600 / 12)
    assert (m.itl.p50, m.itl.p90) == pytest.approx((100.0, 200.0))
    # E2E ms sorted [300, 500, 800, 1000]
    assert m.e2e.p50 == pytest.approx(650.0)
    assert m.e2e.p99 == pytest.approx(800 + 0.97 * 200)
    assert m.e2e.max == pytest.approx(1000.0)
    assert m.total_cached_tokens == 180
    assert m.cache_hit_rate == pytest.approx(180 / 500)
    rec = m.to_record()
    assert rec["median_ttft_ms"] == pytest.approx(250.0)
    assert rec["p99_e2e_latency_ms"] == pytest.approx(994.0)


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 250 ms: requests 1, 2; TPOT <= 150 ms: 1, 3 (one token: 0), 4
    g = goodput(OUTS, {"ttft": 250.0, "tpot": 150.0}, duration_s=2.0)
    assert g.good == 1 and g.request_goodput == 0.5
    assert g.attainment == pytest.approx(1 / 5)
    assert g.attainment_by_slo == pytest.approx({"ttft": 2 / 5, "tpot": 3 / 5})
    g = goodput(OUTS, {"e2e": 800.0}, duration_s=4.0)
    assert g.good == 3 and g.request_goodput == 0.75
    m = summarize(OUTS, 2.0, {"ttft": 250.0, "tpot": 150.0})
    assert m.goodput is not None and m.goodput.good == 1


def test_cache_hit_rate_is_none_when_the_server_reports_nothing():
    outs = [_out(0.1, 0.2, 2, [0.1])]
    m = summarize(outs, 1.0)
    assert m.cache_hit_rate is None and m.total_cached_tokens is None
    assert m.itl.p50 == pytest.approx(100.0)
    nothing = summarize([_out(0, 0, 0, [], ok=False)], 1.0)
    assert nothing.completed == 0 and math.isnan(nothing.ttft.p50)


def test_parse_slo():
    assert parse_slo("ttft=200,tpot=50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo("e2el:900") == {"e2e": 900.0}
    for bad in ("", "ttft", "itl=3", "ttft=-1", "ttft=abc"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_parse_request_rates():
    assert parse_request_rates("inf") == [math.inf]
    assert parse_request_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0", "-2", "fast"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_request_rates(bad)


def test_arrivals_poisson_and_gamma():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    n, rate = 20000, 4.0
    for burstiness in (1.0, 0.25, 4.0):
        offs = arrival_offsets(n, rate, burstiness, seed=3)
        assert offs[0] == 0.0 and offs == sorted(offs)
        gaps = [b - a for a, b in zip(offs, offs[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(1 / rate, rel=0.05)
        # a gamma of shape k has coefficient of variation 1 / sqrt(k)
        assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness ** -0.5, rel=0.08)
    assert arrival_offsets(50, 2.0, 1.0, 7) == arrival_offsets(50, 2.0, 1.0, 7)
