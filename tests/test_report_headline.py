"""The report's headline: its comparisons Holm-adjusted over each other, each with the
equivalence test (TOST) at the stated margin, read as worse / better / level / not resolved."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats as st

from qkvlab.experiments.headline import Comparison, wd_text
from qkvlab.experiments.results import PairedRelative
from qkvlab.experiments.stats import paired_t, tost_paired


def comparison(diffs: list[float], ref: float = 1.5, p_holm: float | None = None,
               margin_pct: float = 0.5) -> Comparison:
    test = paired_t(diffs)
    pr = PairedRelative(list(range(1, len(diffs) + 1)), test, ref, None, (None, None), diffs)
    return Comparison("qid", "base", "qid", {}, (1.0, 1.0), (0.03125, 0.1), pr, p_holm,
                      pr.equivalence(margin_pct))


def test_a_comparison_is_read_from_holms_p_and_the_equivalence_test():
    # +0.15% with a tight spread: inside +-0.5% (TOST), and a difference where Holm allows
    tight = [0.0021, 0.0023, 0.0024]
    assert comparison(tight, p_holm=0.2).reading(0.5) == "level within ±0.5%"
    assert comparison(tight, p_holm=0.01).reading(0.5) == "worse, by less than ±0.5%"
    # -1.5% and tight: better, and outside the margin
    assert comparison([-0.022, -0.023, -0.0225], p_holm=0.001).reading(0.5) == "better"
    # a wide spread around +0.3%: neither
    assert comparison([-0.02, 0.005, 0.03], p_holm=0.7).reading(0.5) == "not resolved at ±0.5%"
    # the margin decides: a spread whose 90% interval fits inside +-2% is level at that margin
    wide = comparison([-0.002, 0.0, 0.003], p_holm=0.9, margin_pct=2.0)
    assert wide.reading(2.0) == "level within ±2%"
    assert comparison([0.004], p_holm=None).reading(0.5) == "one seed: no test"


def test_the_equivalence_margin_is_a_share_of_the_reference_loss():
    diffs = [0.0021, 0.0023, 0.0024]
    eq = comparison(diffs, ref=1.5).equivalence
    assert eq.margin == pytest.approx(0.005 * 1.5)
    want = tost_paired(diffs, 0.0075)
    assert (eq.p, eq.ci_low, eq.ci_high) == (want.p, want.ci_low, want.ci_high)


def test_weight_decay_is_written_as_the_docs_write_it():
    assert [wd_text(x) for x in (0.03125, 0.1, 0.0, 0.5)] == ["2^-5", "0.1", "0", "2^-1"]


def _by_hand_holm(ps: list[float]) -> list[float]:
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - k) * ps[i]))
        out[i] = running
    return out


def test_a_sweeps_headline_is_holm_adjusted_with_a_tost_at_the_stated_margin(
        tmp_path, data_dir, capsys):
    from qkvlab.cli import main
    from test_stats_report import sweep_report

    data, text, rep = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "qid-std"
rule = "q-identity"
attn_scale = 0.7
""")
    head = data["headline"]
    assert head["kind"] == "reference" and head["margin_pct"] == 0.5
    assert data["equivalence_margin_pct"] == 0.5
    rows = {c["group"]: c for c in head["comparisons"]}
    assert set(rows) == {"qid", "qid-std"} and head["holm_over"] == 2
    runs = {(r["group"], r["seed"]): r["final_val_loss"] for r in data["runs"]}
    ps = [rows[g]["p"] for g in ("qid", "qid-std")]
    assert [rows[g]["p_holm"] for g in ("qid", "qid-std")] == pytest.approx(_by_hand_holm(ps))
    for g, c in rows.items():
        diffs = [runs[(g, s)] - runs[("baseline", s)] for s in (1, 2)]
        ref = (runs[("baseline", 1)] + runs[("baseline", 2)]) / 2
        mean, sd = sum(diffs) / 2, abs(diffs[0] - diffs[1]) / math.sqrt(2)
        se, margin = sd / math.sqrt(2), 0.005 * ref
        eq = c["equivalence"]
        assert eq["margin"] == pytest.approx(margin) and eq["margin_pct"] == 0.5
        half = st.t.ppf(0.95, 1) * se  # the 90% interval, 1 degree of freedom
        assert (eq["ci_low"], eq["ci_high"]) == pytest.approx((mean - half, mean + half))
        assert eq["ci_pct"] == pytest.approx([100 * (mean - half) / ref,
                                              100 * (mean + half) / ref])
        p = max(st.t.sf((mean + margin) / se, 1), st.t.cdf((mean - margin) / se, 1))
        assert eq["p"] == pytest.approx(p) and eq["equivalent"] == (p < 0.05)
        assert (c["weight_decay"], c["reference_weight_decay"]) == (0.03125, 0.1)
    assert "## The answer" in text and "a margin of ±0.5% of the reference's loss" in text
    assert "| TOST p (±0.5%) | reading |" in text and "![headline](gaps.png)" in text
    assert "2 of the 2 comparisons have arms at different weight decays" in text
    assert (rep / "gaps.png").stat().st_size > 5_000
    # a wider margin is stated wherever the test is, and recorded in the command line
    assert main(["report", str(tmp_path / "sw"), "--out", str(tmp_path / "r2"),
                 "--margin", "2"]) == 0
    again = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert again["headline"]["margin_pct"] == 2.0 and "--margin 2" in again["command"]
    assert all(c["equivalence"]["margin_pct"] == 2.0 for c in again["headline"]["comparisons"])
    assert "±2%" in (tmp_path / "r2" / "report.md").read_text()


@pytest.mark.parametrize("bad", ["0", "-1", "100", "nan"])
def test_a_margin_outside_0_to_100_is_refused_in_one_line(tmp_path, capsys, bad):
    from qkvlab.cli import main

    spec = tmp_path / "nothing"
    assert main(["report", str(spec), "--margin", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--margin" in err[0] and "Traceback" not in err[0]
