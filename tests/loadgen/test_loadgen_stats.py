"""Percentiles, ratios and per-server figures."""

from __future__ import annotations

import math
import statistics

import pytest

from kvtier.loadgen.stats import Sample, figures, percentile, ratio, ratios, spread, sum_counts


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5 == statistics.median(xs)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    data = [0.3, 0.1, 0.9, 0.4, 0.25, 0.6, 0.8]
    assert percentile(data, 90) == pytest.approx(statistics.quantiles(data, n=10, method="inclusive")[8])
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_ratio_is_none_unless_both_figures_are_positive_and_finite() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(0.0, 1.0) is None and ratio(1.0, 0.0) is None
    assert ratio(None, 1.0) is None and ratio(1.0, math.inf) is None


def test_figures_and_ratios() -> None:
    a = Sample(ttft_s=1.0, latency_s=2.0, gaps_s=(0.1, 0.1, 0.5), output_tokens=4, prompt_tokens=10)
    b = Sample(ttft_s=3.0, latency_s=4.0, gaps_s=(0.2,), output_tokens=2, prompt_tokens=20)
    f = figures([a, b])
    assert f["ttft_p50_s"] == 2.0 and f["ttft_p90_s"] == pytest.approx(2.8)
    assert f["itl_p99_s"] == pytest.approx(percentile([0.1, 0.1, 0.5, 0.2], 99))
    assert f["output_tokens_per_s"] == pytest.approx((4 / 2 + 2 / 4) / 2)  # median of 2.0 and 0.5
    assert f["output_tokens"] == 6 and f["prompt_tokens"] == 30 and f["requests"] == 2
    g = figures([a])
    r = ratios(g, f)  # with / without
    assert r["ttft_p50_s"] == pytest.approx(0.5) and r["output_tokens_per_s"] == pytest.approx(2.0 / 1.25)
    assert figures([])["ttft_p50_s"] is None


def test_spread_is_median_min_max_and_the_wider_side_over_the_median() -> None:
    sp = spread([2.0, 1.6, 2.1, None])
    assert (sp["median"], sp["min"], sp["max"], sp["repeats"]) == (2.0, 1.6, 2.1, 3)
    assert sp["margin"] == pytest.approx(0.2)  # (2.0 - 1.6) / 2.0, the wider side
    assert sp["coverage"] == pytest.approx(0.75)  # [min, max] of 3 holds the median repeat
    assert spread([4.0, 2.0])["median"] == 3.0 and spread([4.0, 2.0])["margin"] == pytest.approx(1 / 3)
    one = spread([1.5])
    assert one["median"] == 1.5 and one["margin"] is None  # one repeat states no margin
    assert spread([None, math.nan])["median"] is None and spread([])["repeats"] == 0


def test_sum_counts_adds_dicts_key_by_key() -> None:
    assert sum_counts([{"x": 1, "y": {"z": 2}}, {"x": 3, "y": {"z": 4, "w": 1}}]) == {"x": 4, "y": {"z": 6, "w": 1}}
    assert sum_counts([{"cpu": 128}, {"cpu": None}]) == {"cpu": None}  # a count not taken stays unknown
    assert sum_counts([1, 2, 3]) == 6 and sum_counts([]) == 0
