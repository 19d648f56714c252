"""Holm's adjustment and the sign-test floor that every sweep report states."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkvlab.experiments.stats import holm, sign_test_floor


def test_holm_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 -> max(0.06, 0.04)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.2, None, 0.3]) == [0.4, None, 0.4]  # None: not a test, not counted
    assert holm([]) == []


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_never_lowers_p_and_keeps_the_order(ps):
    adj = holm(ps)
    assert all(p <= a <= 1.0 for p, a in zip(ps, adj, strict=True))
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    assert all(adj[i] <= adj[j] for i, j in zip(order, order[1:], strict=False))


def test_sign_test_floor():
    from scipy.stats import binomtest

    for n in range(1, 9):
        assert sign_test_floor(n) == pytest.approx(binomtest(n, n, 0.5).pvalue)
    assert sign_test_floor(3) == 0.25 and sign_test_floor(6) < 0.05 < sign_test_floor(5)
