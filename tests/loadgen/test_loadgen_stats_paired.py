"""The paired estimates of `kvtier bench serve` and the z-test between runs (loadgen/stats.py),
on constructed data whose answers are known in closed form."""

from __future__ import annotations

import math

import pytest

from kvtier.loadgen.stats import Z95, agree, over_repeats, paired, t975


def _pairs(ratios: list[list[float]], den: float = 0.25) -> tuple[list[list[float]], list[list[float]]]:
    """(num, den) per repeat and prompt whose ratios num/den are `ratios`."""
    return [[r * den for r in rep] for rep in ratios], [[den] * len(rep) for rep in ratios]


def test_paired_geomean_with_an_interval_from_per_prompt_residuals() -> None:
    d = 0.1
    # prompts of ratio 2 and 4, each at e^(+d) in one repeat and e^(-d) in the other, in opposite
    # directions (no shift of a whole repeat: the repeats' means are equal)
    num, den = _pairs([[2 * math.exp(d), 4 * math.exp(-d)], [2 * math.exp(-d), 4 * math.exp(d)]])
    e = paired(num, den)
    assert e is not None
    assert e["estimate"] == pytest.approx(math.sqrt(8))  # geomean of 2 and 4
    # residuals +-d (4 of them), N(R-1) = 2 degrees of freedom: sd = sqrt(4 d^2 / 2); se = sd / sqrt(4)
    sd = math.sqrt(4 * d * d / 2)
    assert e["sd_log"] == pytest.approx(sd) and e["df"] == 2 and e["pairs"] == 4 and e["repeats"] == 2
    assert e["se_log"] == pytest.approx(sd / 2)
    t = t975(2)
    assert e["low"] == pytest.approx(math.sqrt(8) * math.exp(-t * sd / 2))
    assert e["high"] == pytest.approx(math.sqrt(8) * math.exp(t * sd / 2))
    assert e["margin"] == pytest.approx(math.expm1(t * sd / 2))
    assert e["values"] == pytest.approx([math.sqrt(8), math.sqrt(8)])  # per repeat
    assert e["method"] == "paired, stratified by prompt"
    # the prompts' own levels are the design, not noise: 2 and 40 instead of 2 and 4, same interval
    wide = paired(*_pairs([[2 * math.exp(d), 40 * math.exp(-d)], [2 * math.exp(-d), 40 * math.exp(d)]]))
    assert wide is not None and wide["se_log"] == pytest.approx(e["se_log"])


def test_a_shift_of_whole_repeats_widens_the_paired_interval() -> None:
    """Every pair of repeat 1 at e^(+d), of repeat 2 at e^(-d): a shift shared by the repeat, which
    the per-prompt residuals alone would count as N independent draws. The spread of the repeats'
    means is used instead, with R - 1 degrees of freedom."""
    d = 0.1
    e = paired(*_pairs([[2 * math.exp(d), 4 * math.exp(d)], [2 * math.exp(-d), 4 * math.exp(-d)]]))
    assert e is not None and e["estimate"] == pytest.approx(math.sqrt(8))
    # repeat means +d and -d: sd sqrt(2 d^2 / 1), se = sd / sqrt(2) = d, against stratified d / sqrt(2)
    assert e["se_log"] == pytest.approx(d) and e["df"] == 1 and e["method"].startswith("paired, between repeats")
    assert e["high"] == pytest.approx(math.sqrt(8) * math.exp(t975(1) * d))


def test_paired_with_one_repeat_falls_back_to_the_plain_per_pair_error() -> None:
    logs = [0.0, 0.2, 0.7]
    e = paired(*_pairs([[math.exp(x) for x in logs]]))
    assert e is not None
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    assert e["estimate"] == pytest.approx(math.exp(mean)) and e["se_log"] == pytest.approx(sd / math.sqrt(3))
    assert e["method"].startswith("paired, per pair (one repeat")
    one = paired([[2.0]], [[1.0]])
    assert one is not None and one["estimate"] == 2.0 and one["se_log"] is None and one["low"] is None


def test_paired_leaves_out_a_prompt_missing_in_any_repeat() -> None:
    e = paired([[2.0, None, 8.0], [2.0, 3.0, 8.0]], [[1.0, 1.0, 2.0], [1.0, 1.0, 2.0]])
    assert e is not None and e["pairs"] == 4 and e["estimate"] == pytest.approx(math.sqrt(8))
    assert e["se_log"] == 0.0  # no noise left: every prompt the same in both repeats
    assert paired([[0.0]], [[1.0]]) is None and paired([], []) is None


def test_over_repeats_is_a_t_interval_of_the_logs() -> None:
    e = over_repeats([math.exp(0.1), math.exp(0.2), None, math.exp(0.3)])
    assert e is not None and e["repeats"] == 3 and e["df"] == 2
    se = 0.1 / math.sqrt(3)  # sd of 0.1, 0.2, 0.3 is 0.1
    assert e["estimate"] == pytest.approx(math.exp(0.2)) and e["se_log"] == pytest.approx(se)
    assert e["low"] == pytest.approx(math.exp(0.2 - 4.303 * se)) and e["high"] == pytest.approx(math.exp(0.2 + 4.303 * se))
    assert e["method"].startswith("t over 3 repeats")
    assert over_repeats([1.2])["se_log"] is None and over_repeats([None, 0.0]) is None  # type: ignore[index]


def test_t975() -> None:
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(30) == 2.042
    assert t975(31) == pytest.approx(2.0395, abs=1e-3) and t975(120) == pytest.approx(1.9799, abs=1e-3)
    assert t975(10**6) == pytest.approx(Z95, abs=1e-5)
    with pytest.raises(ValueError):
        t975(0)


def test_agree_is_a_z_test_on_the_log_difference() -> None:
    se = 0.05
    a = {"estimate": 2.0, "se_log": se}

    def b(d: float, se_b: float = se) -> dict[str, float]:
        return {"estimate": 2.0 * math.exp(d), "se_log": se_b}

    s = math.sqrt(2) * se  # sqrt(se_a^2 + se_b^2)
    near = agree(a, b(0.1))
    assert near["z"] == pytest.approx(-0.1 / s) and near["agree"] is True and near["ratio"] == pytest.approx(math.exp(-0.1))
    far = agree(a, b(0.2))
    assert far["z"] == pytest.approx(-0.2 / s) and far["agree"] is False
    # right at the bound agrees; 1% past it does not (sums of standard errors, or 2 for 1.96, would
    # say otherwise)
    assert agree(a, b(Z95 * s))["agree"] is True and agree(a, b(1.01 * Z95 * s))["agree"] is False
    # unequal errors combine in quadrature: se_b = 0.12, s = 0.13
    assert agree(a, b(0.25, 0.12))["z"] == pytest.approx(-0.25 / 0.13) and agree(a, b(0.25, 0.12))["agree"] is True
    assert agree(a, {"estimate": 2.0, "se_log": None})["agree"] is None and agree(a, None)["agree"] is None
    exact = {"estimate": 2.0, "se_log": 0.0}
    assert agree(exact, exact) == {"z": 0.0, "agree": True, "ratio": 1.0, "crit": Z95}
    # with degrees of freedom on both sides, t at the smaller: 2 repeats' SE is itself uncertain
    few = {"estimate": 2.0, "se_log": se, "df": 2}
    assert agree(few, {**b(3 * s), "df": 50})["agree"] is True  # |z| = 3 < t(2) = 4.30
    assert agree(few, {**b(4.4 * s), "df": 50})["agree"] is False and agree(few, few)["crit"] == pytest.approx(t975(2))
    assert agree(exact, {"estimate": 2.1, "se_log": 0.0})["agree"] is False
    assert agree(exact, {"estimate": 2.1, "se_log": 0.0})["z"] is None
