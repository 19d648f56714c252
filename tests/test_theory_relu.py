"""ReLU skip absorption (docs/paper.md section 4): the index-set condition and its construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkvlab.errors import QkvlabError
from qkvlab.theory.relu_skip import (
    absorb,
    absorbable,
    generic_example,
    mlp,
    positive_example,
    same_width_fit,
    skip_defect,
    widen_exact,
)

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F64 = torch.float64


def points(d: int, seed: int, n: int = 256) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@st.composite
def positive_cases(draw):
    d = draw(st.integers(1, 5))
    m = draw(st.integers(d, 3 * d + 4))
    k = draw(st.integers(d, m))
    return d, m, k, draw(st.integers(0, 2**16))


@PROPS
@given(case=positive_cases())
def test_index_set_is_found_and_absorbs_the_skip(case):
    d, m, k, seed = case
    W1, W2, S = positive_example(d, m, seed, k)
    found = absorbable(W1, W2)
    assert found is not None
    assert skip_defect(W1, W2, found) < 1e-9 and len(found) >= d
    A1, A2 = absorb(W1, W2, found)
    assert A1.shape == W1.shape and A2.shape == W2.shape  # the SAME width m
    x = points(d, seed)
    assert max_diff(mlp(A1, A2, x, skip=False), mlp(W1, W2, x, skip=True)) < 1e-10
    # the planted S works too, and is what the construction flips
    B1, _ = absorb(W1, W2, S)
    assert max_diff(mlp(B1, W2, x, skip=False), mlp(W1, W2, x, skip=True)) < 1e-10


@PROPS
@given(d=st.integers(1, 5), extra=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_generic_weights_have_no_index_set(d, extra, seed):
    W1, W2 = generic_example(d, d + extra, seed)
    assert absorbable(W1, W2) is None
    with pytest.raises(QkvlabError, match="section 4: no index set S"):
        absorb(W1, W2)


@PROPS
@given(d=st.integers(1, 6), m=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_width_m_plus_2d_is_always_exact(d, m, seed):
    W1, W2 = generic_example(d, m, seed)
    V1, V2 = widen_exact(W1, W2)
    assert V1.shape == (m + 2 * d, d) and V2.shape == (d, m + 2 * d)
    x = points(d, seed)
    assert max_diff(mlp(V1, V2, x, skip=False), mlp(W1, W2, x, skip=True)) < 1e-10


def test_search_is_complete_with_dependent_units():
    """m > d^2: units are linearly dependent, the search enumerates the free ones."""
    W1, W2, _ = positive_example(2, 9, seed=3, k=4)
    S = absorbable(W1, W2)
    assert S is not None and skip_defect(W1, W2, S) < 1e-9
    # pairs (w, -w) with opposite output weights: relu(t) - relu(-t) = t appears inside W
    e = torch.eye(2, dtype=F64)
    W1 = torch.cat([e, -e, torch.randn(3, 2, dtype=F64)])
    W2 = torch.cat([-e, e, torch.randn(2, 3, dtype=F64)], dim=1)  # sums to -relu(x)+relu(-x)
    S = absorbable(W1, W2)
    assert S is not None and skip_defect(W1, W2, S) < 1e-12


def test_zero_units_and_duplicates():
    W1, W2, _ = positive_example(2, 4, seed=1, k=2)
    W1 = torch.cat([W1, torch.zeros(2, 2, dtype=F64)])  # dead units never matter
    W2 = torch.cat([W2, torch.randn(2, 2, dtype=F64)], dim=1)
    assert absorbable(W1, W2) is not None


@pytest.mark.parametrize("d,m,seed", [(3, 4, 0), (4, 6, 1), (4, 8, 2)])
def test_same_width_fit_keeps_a_non_vanishing_error(d, m, seed):
    W1, W2 = generic_example(d, m, seed)
    fit = same_width_fit(W1, W2, steps=250, n=1024, seed=seed)
    assert fit.W1.shape == (m, d)
    assert fit.rel_error > 1e-3 and fit.max_abs_error > 1e-3  # ~1e8 x rounding error


def test_bad_input_is_a_one_line_error():
    W1 = torch.randn(5, 3, dtype=F64)
    with pytest.raises(QkvlabError, match=r"shape mismatch: W1 is 5 x 3 \(m x d\), so W2 must "
                                          r"be 3 x 5"):
        absorbable(W1, torch.randn(5, 3, dtype=F64))
    with pytest.raises(QkvlabError, match="must be matrices"):
        absorbable(torch.randn(3, dtype=F64), torch.randn(3, 3, dtype=F64))
    with pytest.raises(QkvlabError, match="finite"):
        absorbable(W1 * float("nan"), torch.randn(3, 5, dtype=F64))
    with pytest.raises(QkvlabError, match="does not absorb the skip"):
        absorb(W1, torch.randn(3, 5, dtype=F64), (0, 1, 2))
    with pytest.raises(QkvlabError, match="not a set of distinct hidden units"):
        absorb(W1, torch.randn(3, 5, dtype=F64), (0, 0, 9))
    with pytest.raises(QkvlabError, match="need d <= k <= m"):
        positive_example(3, 4, 0, k=5)
