"""Statistics on synthetic timings with known answers."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.load.client import RequestResult
from bench.load.stats import SLO, percentile, summarize


def test_percentile_interpolates_linearly_between_closest_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)  # rank 8.1
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_percentile_matches_statistics_inclusive_method():
    values = [0.3, 5.0, 1.2, 9.9, 4.4, 2.2, 7.1]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for p in (10, 50, 90, 99):
        assert percentile(values, p) == pytest.approx(cuts[p - 1])


def _results() -> list[RequestResult]:
    a = RequestResult(0.0, ttft_s=0.1, itl_s=[0.01, 0.03], e2e_s=0.14, prompt_tokens=10,
                      output_tokens=3, cached_tokens=4)  # fmt: skip
    b = RequestResult(0.5, ttft_s=0.3, itl_s=[0.02], e2e_s=0.32, prompt_tokens=30,
                      output_tokens=2, cached_tokens=0)  # fmt: skip
    c = RequestResult(1.0, e2e_s=0.05, error="http_500")
    return [a, b, c]


def test_summary_ttft_itl_e2e_and_throughput():
    s = summarize(_results(), duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"http_500": 1})
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["p50"] == pytest.approx(200)
    # ITL pools every gap: [10, 20, 30] ms -> p90 at rank 1.8 = 28 ms
    assert s["itl_ms"]["mean"] == pytest.approx(20)
    assert s["itl_ms"]["p90"] == pytest.approx(28)
    assert s["e2e_ms"]["p50"] == pytest.approx(230)
    assert s["tpot_ms"]["mean"] == pytest.approx(20)  # (140-100)/2 and (320-300)/1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(22.5)
    assert s["per_user_output_tok_s"] == pytest.approx(50)
    assert s["cache_hit_rate"] == pytest.approx(0.1)


def test_goodput_counts_requests_meeting_both_slos():
    results = _results()
    assert summarize(results, 2.0)["goodput"] == pytest.approx(1.0)  # no SLO: all ok ones
    assert summarize(results, 2.0, SLO(ttft_ms=200))["goodput"] == pytest.approx(0.5)
    assert summarize(results, 2.0, SLO(ttft_ms=400, itl_ms=25))["goodput"] == pytest.approx(1.0)
    assert summarize(results, 2.0, SLO(ttft_ms=400, itl_ms=15))["goodput"] == 0.0


def test_empty_run_gives_nan_not_an_exception():
    s = summarize([RequestResult(0.0, error="timeout")], duration_s=1.0)
    assert s["completed"] == 0 and math.isnan(s["ttft_ms"]["p99"])
