"""The statistics of the experiment report: means over seeds, paired t-tests, equivalence
tests (TOST), Holm's adjustment, run speed.

Why paired: every run of a sweep is scored on the same fixed validation windows, and runs that
share a seed share their batch order, so the difference variant - baseline at the same seed
removes most of the seed-to-seed spread that the two losses share. The test is scipy's
one-sample t-test of those differences against 0 (the same as scipy.stats.ttest_rel on the two
loss lists), with its t-based confidence interval. With n = 2 pairs the interval is wide
(t_0.975 with 1 degree of freedom is 12.7): that is what two seeds can say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Summary:
    """Mean and sample standard deviation (ddof = 1; None for n < 2) of a list of values."""

    n: int
    mean: float | None
    std: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return Summary(0, None, None)
    mean = math.fsum(vals) / n
    if n < 2:
        return Summary(n, mean, None)
    var = math.fsum((v - mean) ** 2 for v in vals) / (n - 1)
    return Summary(n, mean, math.sqrt(var))


@dataclass(frozen=True)
class PairedTest:
    """A paired t-test of differences d_i (variant - baseline) against 0.

    mean/std/se describe the differences; t = mean / se with n - 1 degrees of freedom; p is
    two-sided; [ci_low, ci_high] is the `confidence` interval of the mean difference. Fields a
    sample this small cannot give are None (n = 1: no spread, no test).
    """

    n: int
    mean: float | None
    std: float | None
    se: float | None
    t: float | None
    df: int
    p: float | None
    ci_low: float | None
    ci_high: float | None
    confidence: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def significant(self) -> bool:
        """The interval excludes 0 (p < 1 - confidence)."""
        return self.p is not None and self.p < 1 - self.confidence


def paired_t(diffs: Sequence[float], confidence: float = 0.95) -> PairedTest:
    """The paired t-test of `diffs` (one difference per pair) with a t confidence interval."""
    from scipy import stats as st  # 0.5 s to import (measured): only a test pays for it

    s = summarize(diffs)
    df = max(s.n - 1, 0)
    if s.n < 2 or s.std is None or s.mean is None:
        return PairedTest(s.n, s.mean, None, None, None, df, None, None, None, confidence)
    if max(diffs) == min(diffs):
        # every pair differs by the same amount: no spread to test against (and the computed
        # std is rounding noise, which must not become a huge t)
        d = float(diffs[0])
        t = 0.0 if d == 0 else math.copysign(math.inf, d)
        p = 1.0 if d == 0 else 0.0
        return PairedTest(s.n, d, 0.0, 0.0, t, df, p, d, d, confidence)
    test = st.ttest_1samp(diffs, 0.0)
    ci = test.confidence_interval(confidence)
    return PairedTest(s.n, s.mean, s.std, s.std / math.sqrt(s.n), float(test.statistic), df,
                      float(test.pvalue), float(ci.low), float(ci.high), confidence)


@dataclass(frozen=True)
class EquivalenceTest:
    """Two one-sided paired t-tests (TOST): is the mean difference inside (-margin, +margin)?

    p is the larger of the two one-sided p-values, and the pair is `equivalent` ("level",
    within the margin) when p < alpha: the same as the 1 - 2 alpha interval [ci_low, ci_high]
    (90% for alpha 0.05) lying inside the margin. The margin is part of the answer, so every
    output that calls two arms level states it. Fields a sample this small cannot give are None.
    """

    n: int
    mean: float | None
    se: float | None
    df: int
    margin: float
    p_lower: float | None  # H0: mean <= -margin
    p_upper: float | None  # H0: mean >= +margin
    p: float | None
    ci_low: float | None
    ci_high: float | None
    alpha: float

    @property
    def equivalent(self) -> bool:
        return self.p is not None and self.p < self.alpha

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "equivalent": self.equivalent}


def tost_paired(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> EquivalenceTest:
    """TOST of paired differences `diffs` (variant - reference, one per pair) against the
    equivalence margin (-margin, +margin), in the units of `diffs` (a loss, or a percentage of
    the reference loss)."""
    from scipy import stats as st  # see paired_t

    if not margin > 0:
        raise ValueError(f"the equivalence margin must be positive, got {margin}")
    s = summarize(diffs)
    df = max(s.n - 1, 0)
    if s.n < 2 or s.std is None or s.mean is None:
        return EquivalenceTest(s.n, s.mean, None, df, margin, None, None, None, None, None, alpha)
    if max(diffs) == min(diffs):  # no spread: the difference is known exactly (see paired_t)
        d = float(diffs[0])
        p_lo, p_hi = float(d <= -margin), float(d >= margin)
        return EquivalenceTest(s.n, d, 0.0, df, margin, p_lo, p_hi, max(p_lo, p_hi), d, d, alpha)
    se = s.std / math.sqrt(s.n)
    p_lo = float(st.t.sf((s.mean + margin) / se, df))
    p_hi = float(st.t.cdf((s.mean - margin) / se, df))
    half = float(st.t.ppf(1 - alpha, df)) * se
    return EquivalenceTest(s.n, s.mean, se, df, margin, p_lo, p_hi, max(p_lo, p_hi),
                           s.mean - half, s.mean + half, alpha)


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of the p-values of one report's comparisons (None stays
    None and does not count): the family-wise error stays at the nominal level however many
    variants are compared with the reference."""
    ranked = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m, out, running = len(ranked), list(pvalues), 0.0
    for k, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (m - k) * p))  # monotone in the sorted order
        out[i] = running
    return out


def sign_test_floor(n: int) -> float:
    """The smallest two-sided p a sign test over n pairs can give (all n differences of one
    sign): 2 / 2^n, 0.25 for 3 seeds; below 6 pairs it cannot reach 0.05."""
    return min(1.0, 2.0 * 0.5 ** n) if n > 0 else 1.0


def relative(value: float | None, reference: float | None) -> float | None:
    """100 * value / reference (a difference as a percentage of the reference loss)."""
    if value is None or reference is None or reference == 0:
        return None
    return 100.0 * value / reference


def median_tokens_per_s(records: Sequence[dict[str, Any]]) -> float | None:
    """Median logged training speed of a run's metrics records, skipping the first quarter
    (allocation, first-touch and warm-up make the early steps slow)."""
    values = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    values = sorted(values[len(values) // 4:])
    return values[len(values) // 2] if values else None
