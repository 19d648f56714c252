"""The paired equivalence test (TOST) and Holm's adjustment, against hand values and statsmodels."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkvlab.experiments.stats import holm, tost_paired


def test_tost_by_hand():
    # diffs 0.1, 0.2, 0.3: mean 0.2, sd 0.1, se 0.1 / sqrt(3) = 0.057735, df 2.
    # Against margin 0.5: t_lower = (0.2 + 0.5) / se = 12.124, t_upper = (0.2 - 0.5) / se = -5.196.
    # The t(2) tails: P(T > 12.124) = 0.003367, P(T < -5.196) = 0.017549 (closed form for df 2:
    # P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2).
    def tail(t: float) -> float:
        return (1 - t / math.sqrt(t * t + 2)) / 2

    se = 0.1 / math.sqrt(3)
    r = tost_paired([0.1, 0.2, 0.3], 0.5)
    assert r.mean == pytest.approx(0.2) and r.se == pytest.approx(se)
    assert r.p_lower == pytest.approx(tail(0.7 / se))
    assert r.p_upper == pytest.approx(tail(0.3 / se))
    assert r.p == pytest.approx(0.017549, abs=1e-6) and r.equivalent
    # the 90% interval: t_0.95(2) = 2.919986
    assert (r.ci_low, r.ci_high) == pytest.approx((0.2 - 2.919986 * se, 0.2 + 2.919986 * se))
    assert r.as_dict()["margin"] == 0.5 and r.as_dict()["equivalent"] is True


def test_tost_not_equivalent_when_the_interval_reaches_the_margin():
    r = tost_paired([0.1, 0.2, 0.3], 0.3)  # 90% interval up to 0.369 > 0.3
    assert not r.equivalent and r.p > 0.05 and r.ci_high > 0.3
    # a difference of 0 with a wide spread is not "level" either: no evidence is not equivalence
    assert not tost_paired([-1.0, 1.0, -0.5, 0.5], 0.5).equivalent


def test_tost_small_samples_and_bad_margin():
    assert tost_paired([0.1], 0.5).p is None  # one pair: no spread, no test
    exact = tost_paired([0.1, 0.1, 0.1], 0.5)  # no spread: the difference is known
    assert exact.p == 0.0 and exact.equivalent
    assert tost_paired([0.6, 0.6], 0.5).p == 1.0
    with pytest.raises(ValueError, match="margin must be positive"):
        tost_paired([0.1, 0.2], 0.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-2, 2, allow_nan=False), min_size=3, max_size=8),
       st.floats(0.05, 3))
def test_tost_matches_statsmodels(diffs, margin):
    ws = pytest.importorskip("statsmodels.stats.weightstats")
    import numpy as np

    if max(diffs) - min(diffs) < 1e-6:
        return  # statsmodels divides by the zero spread; the exact case is tested above
    ours = tost_paired(diffs, margin)
    p, lower, upper = ws.ttost_paired(np.array(diffs), np.zeros(len(diffs)), -margin, margin)
    assert ours.p == pytest.approx(float(p), abs=1e-9)
    assert ours.p_lower == pytest.approx(float(lower[1]), abs=1e-9)
    assert ours.p_upper == pytest.approx(float(upper[1]), abs=1e-9)
    # the interval rule and the p rule agree
    assert ours.equivalent == (-margin < ours.ci_low and ours.ci_high < margin)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_matches_statsmodels(ps):
    mt = pytest.importorskip("statsmodels.stats.multitest")

    _, theirs, _, _ = mt.multipletests(ps, method="holm")
    assert holm(ps) == pytest.approx([float(p) for p in theirs], abs=1e-12)
