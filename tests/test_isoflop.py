"""IsoFLOP curves: the parabola in ln N and its vertex, the arms' minima compared over the seeds
that did not pick them (Holm over budgets), the gap's line against compute; and the report's
section and figures on a tiny sweep trained for fixed FLOP budgets."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as sst

from qkvlab.experiments.isoflop import (
    budget_gaps,
    gap_trend,
    isoflop_curves,
    lr_scans,
    paper_flops,
    scaling_fit,
)
from qkvlab.experiments.runs import RunData
from qkvlab.model import ModelConfig
from qkvlab.model.params import count_params, flops_per_token

WIDTHS = (64, 128, 192, 256, 320)


def model(width: int) -> ModelConfig:
    return ModelConfig(n_layer=4, n_head=width // 64, n_embd=width, block_size=128,
                       vocab_size=256)


def run(seed: int, loss: float) -> RunData:
    r = RunData("g", seed, Path(f"g/seed-{seed}"), "done", 10)
    r.final_loss = loss
    return r


def group(family: str, width: int, budget: float, losses: dict[int, float]):
    config = SimpleNamespace(model=model(width), train=SimpleNamespace(flop_budget=budget))
    g = SimpleNamespace(name=f"{family}-d{width}.flops{budget:g}", family=family,
                        config=config)
    return SimpleNamespace(group=g, runs=[run(s, v) for s, v in losses.items()])


def bowl(width: int, centre: float, floor: float) -> float:
    """A loss with its minimum at N = N(centre), quadratic in ln N."""
    x = math.log(count_params(model(width)).non_embedding)
    return floor + 0.05 * (x - math.log(count_params(model(centre)).non_embedding)) ** 2


def sweep(budgets=(1e13, 1e14), fresh=(2, 3, 4)):
    groups = []
    for b, (centre, floor) in zip(budgets, ((128, 2.0), (192, 1.8), (192, 1.7)), strict=False):
        for fam, shift in (("baseline", 0.0), ("qid", -0.01)):
            for w in WIDTHS:
                losses = {1: bowl(w, centre, floor + shift)}
                if w == centre:  # the minimum: fresh seeds, qid 0.5% +- a little below
                    losses |= {s: floor + shift + 0.001 * (s - 3) * (1 if fam == "qid" else 0)
                               for s in fresh}
                groups.append(group(fam, w, b, losses))
    return SimpleNamespace(groups=groups)


def test_each_curve_finds_its_vertex_inside_the_sizes_run():
    curves = isoflop_curves(sweep())
    assert [(c.family, c.budget) for c in curves] == [
        ("baseline", 1e13), ("baseline", 1e14), ("qid", 1e13), ("qid", 1e14)]
    base = curves[0]
    assert base.seed == 1 and [p.width for p in base.points] == list(WIDTHS)
    n_star, l_star = base.vertex
    assert base.inside and n_star == pytest.approx(count_params(model(128)).non_embedding,
                                                   rel=1e-6)
    assert l_star == pytest.approx(2.0, abs=1e-9) and base.minimum.width == 128
    assert curves[1].minimum.width == 192


def test_a_curve_whose_vertex_lies_beyond_the_sizes_is_not_trusted():
    groups = [group("baseline", w, 1e13, {1: bowl(w, 640, 2.0)}) for w in WIDTHS]
    (c,) = isoflop_curves(SimpleNamespace(groups=groups))
    assert c.vertex is not None and not c.inside and c.minimum.width == 320


def test_a_vertex_is_untrusted_when_the_lowest_size_run_is_an_end():
    # a cliff: the narrowest size far below, the rest on a plateau; the parabola through three
    # points puts its vertex between the sizes, but nothing brackets the minimum
    losses = {64: 1.52, 128: 1.59, 192: 2.39}
    groups = [group("baseline", w, 4e13, {1: v}) for w, v in losses.items()]
    (c,) = isoflop_curves(SimpleNamespace(groups=groups))
    assert c.vertex is not None
    assert c.points[0].params < c.vertex[0] < c.points[-1].params
    assert not c.bracketed and not c.inside and c.as_dict()["vertex_inside"] is False
    # its gap to another curve's vertex is not reported
    other = [group("qid", w, 4e13, {1: v - 0.03}) for w, v in losses.items()]
    curves = isoflop_curves(SimpleNamespace(groups=groups + other))
    (gap,) = budget_gaps(curves, "baseline")
    assert gap.vertex_gap_pct is None
    # nor is it a row of the report's table: nothing to show yet (no fresh seeds either)
    from qkvlab.experiments.render_isoflop import isoflop_section

    text = "\n".join(isoflop_section(curves, [gap], [], [], 0.5, {}))
    assert "family vs reference" not in text and "1 more comparison(s) of minima" in text


def test_the_parabola_reads_the_lowest_run_and_its_neighbours_not_the_plateau_far_off():
    # the ends sit on the early plateau (too short a run for the size); the three sizes around
    # the minimum lie on a bowl centred at d = 192: through all five the vertex would move
    losses = {w: bowl(w, 192, 1.8) for w in (128, 192, 256)} | {64: 2.6, 320: 3.2}
    groups = [group("baseline", w, 1e14, {1: v}) for w, v in losses.items()]
    (c,) = isoflop_curves(SimpleNamespace(groups=groups))
    assert [p.width for p in c.window] == [128, 192, 256] and c.bracketed and c.inside
    n_star, l_star = c.vertex
    assert n_star == pytest.approx(count_params(model(192)).non_embedding, rel=1e-6)
    assert l_star == pytest.approx(1.8, abs=1e-9)
    assert c.as_dict()["window"] == [p.group for p in c.window]
    # at an end, the three sizes nearest it
    ends = [group("baseline", w, 1e14, {1: 2.0 + w / 1000}) for w in WIDTHS]
    (e,) = isoflop_curves(SimpleNamespace(groups=ends))
    assert [p.width for p in e.window] == [64, 128, 192] and not e.inside


def test_a_vertex_far_below_every_run_is_a_cliff_not_a_minimum():
    # 1 layer on the plateau, 2 layers best, 4 a little worse: a parabola through the three
    # drops 5% below every run (measured at 1e13); bracketed, but untrusted
    points = {(64, 1): 2.5297, (64, 2): 1.6986, (64, 4): 1.7537}
    groups = []
    for (w, n), v in points.items():
        g = group("baseline", w, 1e13, {1: v})
        g.group.config.model = ModelConfig(n_layer=n, n_head=1, n_embd=w, block_size=128,
                                           vocab_size=256)
        groups.append(g)
    (c,) = isoflop_curves(SimpleNamespace(groups=groups))
    assert c.bracketed and c.vertex[1] < 0.99 * c.minimum.loss
    assert c.dips and not c.inside and c.as_dict()["vertex_inside"] is False
    # a smooth bowl does not dip
    smooth = isoflop_curves(sweep())[0]
    assert smooth.inside and not smooth.dips


def test_the_minima_are_compared_over_the_fresh_seeds_with_holm_over_budgets():
    curves = isoflop_curves(sweep())
    gaps = budget_gaps(curves, "baseline")
    assert [(g.family, g.budget) for g in gaps] == [("qid", 1e13), ("qid", 1e14)]
    g = gaps[0]
    assert g.shapes == "d 128 x 4 vs d 128 x 4"  # the sizes each minimum was found at
    assert g.fresh.seeds == [2, 3, 4]  # seed 1 picked the minima: not in the test
    diffs = [-0.01 + 0.001 * (s - 3) for s in (2, 3, 4)]
    assert g.fresh.diffs == pytest.approx(diffs)
    want = sst.ttest_1samp(diffs, 0.0).pvalue
    assert g.fresh.test.p == pytest.approx(want)
    ps = [x.fresh.test.p for x in gaps]
    assert [x.p_holm for x in gaps] == pytest.approx(
        [min(1.0, 2 * min(ps)), max(min(1.0, 2 * min(ps)), max(ps))][::1]
        if ps[0] <= ps[1] else [max(min(1.0, 2 * min(ps)), max(ps)), min(1.0, 2 * min(ps))])
    assert g.vertex_gap_pct == pytest.approx(100 * (1.99 / 2.0 - 1), abs=1e-6)


def test_a_family_is_compared_with_the_family_its_versus_names():
    # two arms at a second lr: W_Q = I there against the baseline there, not at the first lr
    groups = sweep().groups
    for g in sweep().groups:
        g.group.family += "-half-lr"
        g.group.name = g.group.name.replace("-d", "-half-lr-d")
        for r in g.runs:
            r.final_loss -= 0.1 if g.group.family.startswith("baseline") else 0.05
        groups.append(g)
    curves = isoflop_curves(SimpleNamespace(groups=groups))
    gaps = budget_gaps(curves, "baseline", {"qid-half-lr": "baseline-half-lr"})
    half = [g for g in gaps if g.family == "qid-half-lr"]
    assert [g.reference.startswith("baseline-half-lr") for g in half] == [True, True]
    assert {g.reference_family for g in half} == {"baseline-half-lr"}  # the figure's legend
    # the half-lr baseline sits 0.1 below, W_Q = I only 0.05: its gap is ~ +0.05 over ~1.9
    assert half[0].fresh.test.mean == pytest.approx(0.05 + np.mean([-0.01 + 0.001 * (s - 3)
                                                               for s in (2, 3, 4)]))
    # a family without a versus still meets the baseline; Holm runs over each family's budgets
    assert {g.family for g in gaps} == {"qid", "baseline-half-lr", "qid-half-lr"}
    ps = sorted(g.fresh.test.p for g in half)
    assert sorted(g.p_holm for g in half) == pytest.approx([min(1.0, 2 * ps[0]),
                                                           max(min(1.0, 2 * ps[0]), ps[1])])


def test_an_lr_scan_is_one_model_at_one_budget_at_several_lrs():
    from qkvlab.run.config import OptimConfig

    def at(family: str, width: int, lr: float, loss: float, wd: float = 0.1):
        g = group(family, width, 1e13, {1: loss, 2: loss + 0.01})
        g.group.config.optim = OptimConfig(lr=lr, weight_decay=wd)
        if family.startswith("q"):  # W_Q = I: another model
            g.group.config.model = dataclasses.replace(model(width), projection="q-identity")
        return g

    groups = [at("b", 64, 1.6e-2, 1.70), at("b-lr8e-3", 64, 8e-3, 1.66),
              at("b-lr4e-3", 64, 4e-3, 1.68),
              at("q", 64, 1.6e-2, 1.68), at("q-lr8e-3", 64, 8e-3, 1.67),
              at("q-lr4e-3", 64, 4e-3, 1.665),
              at("b", 128, 1.6e-2, 1.75), at("b-lr8e-3", 128, 8e-3, 1.7),  # two lrs: no scan
              at("q-wd", 64, 8e-3, 1.60, wd=0.01),  # another weight decay: not q's scan
              *(at(f"b-lr{lr}", 192, lr, 1.6) for lr in (8e-3, 4e-3, 2e-3))]
    (b, q, only_scan) = lr_scans(SimpleNamespace(groups=groups))
    assert only_scan.arm == "b"  # the arm, in whole words: not "b-lr"
    assert (b.arm, b.width, b.seed) == ("b", 64, 1)
    assert [p.lr for p in b.points] == [4e-3, 8e-3, 1.6e-2]
    assert (b.best.lr, b.best.family, b.bracketed) == (8e-3, "b-lr8e-3", True)
    assert q.arm == "q" and [p.family for p in q.points] == ["q-lr4e-3", "q-lr8e-3", "q"]
    assert q.best.lr == 4e-3 and not q.bracketed  # the lowest lr run: a bound
    assert q.as_dict()["best_lr"] == 4e-3


def test_the_gap_trend_is_least_squares_in_log_compute():
    gaps = budget_gaps(isoflop_curves(sweep(budgets=(1e13, 1e14, 1e15))), "baseline")
    trend = gap_trend(gaps, "qid")
    x = [13.0] * 3 + [14.0] * 3 + [15.0] * 3
    y = [100 * d / g.fresh.reference_mean for g in gaps for d in g.fresh.diffs]
    fit = sst.linregress(x, y)
    assert trend.n == 9
    assert (trend.slope, trend.intercept) == pytest.approx((fit.slope, fit.intercept))
    mean, lo, hi = trend.at(1e16)
    se = fit.stderr * math.sqrt(1 / 9 * np.sum((np.array(x) - 14) ** 2) + (16 - 14) ** 2)
    assert mean == pytest.approx(fit.intercept + 16 * fit.slope)
    assert (hi - lo) / 2 == pytest.approx(sst.t.ppf(0.975, 7) * se)
    # two budgets fix a line by their two means, with nothing to check it against: no line
    assert gap_trend(gaps[:2], "qid") is None


def test_an_extrapolated_gap_line_gets_a_panel_of_its_own(tmp_path, monkeypatch):
    import qkvlab.experiments.plots_isoflop as plots

    gaps = budget_gaps(isoflop_curves(sweep(budgets=(1e13, 1e14, 1e15))), "baseline")
    spans, real_save = {}, plots.save

    def keep(plt, fig, path):
        spans[path.name] = [ax.get_xlim() for ax in fig.axes]
        real_save(plt, fig, path)

    monkeypatch.setattr(plots, "save", keep)
    plots.plot_gap_trend(gaps, [gap_trend(gaps, "qid")], 0.5, "t", tmp_path / "line.png",
                         extrapolate_to=4e19)
    plots.plot_gap_trend(gaps, [], 0.5, "t", tmp_path / "none.png", extrapolate_to=4e19)
    (run, far), (alone,) = spans["line.png"], spans["none.png"]
    # the budgets run keep an axis of their own; only the second panel reaches the paper's run
    assert run[1] < 1e16 and far[1] > 4e19 and alone[1] < 1e16


def test_families_gaps_at_one_budget_are_drawn_side_by_side_not_on_one_x():
    from qkvlab.experiments.plots_isoflop import _nudges

    near = _nudges(["a", "b", "c"], [1e13, 4e13])
    assert near["a"] < near["b"] < near["c"]
    assert near["b"] == pytest.approx(1.0)  # centred on the budget
    assert near["a"] * near["c"] == pytest.approx(1.0)
    assert math.log10(near["c"] / near["b"]) == pytest.approx(0.02)  # visible on a short axis
    far = _nudges(["a", "b"], [1e13, 1e19])  # with the paper's run, the axis spans decades
    assert math.log10(far["b"] / far["a"]) == pytest.approx(0.02 * 6)
    assert _nudges([], []) == {}  # no family with fresh seeds yet: nothing to place


@pytest.mark.parametrize("law", [(1.5, 60.0, 0.35, 200.0, 0.33), (1.2, 400.0, 0.5, 50.0, 0.2)])
def test_the_scaling_fit_recovers_a_known_law_and_its_optimum_along_each_budget(law):
    E, A, a, B, b = law

    def loss(w: int, budget: float) -> float:
        m = model(w)
        return E + A / count_params(m).non_embedding ** a + B / (budget / flops_per_token(m)) ** b

    budgets = (1e13, 4e13, 1.6e14)
    groups = [group("fam", w, c, {1: loss(w, c)}) for c in budgets for w in WIDTHS]
    curves = isoflop_curves(SimpleNamespace(groups=groups))
    fit = scaling_fit(curves, "fam")
    assert (fit.points, fit.budgets) == (15, 3)
    assert (fit.E, fit.A, fit.a, fit.B, fit.b) == pytest.approx(law, rel=1e-3)
    for c in curves:
        n_star = fit.optimum(c)
        grid = np.exp(np.linspace(*np.log([c.points[0].params, c.points[-1].params]), 2000))
        # the true optimum along the budget, D(N) log-linear between the sizes as the fit has it
        d = c.budget / np.exp(np.interp(np.log(grid), np.log([p.params for p in c.points]),
                                        np.log([p.flops_per_token for p in c.points])))
        true = grid[np.argmin(E + A / grid ** a + B / d ** b)]
        if true in (grid[0], grid[-1]):
            assert n_star is None  # the law's optimum at an end of the sizes: only a bound
        else:
            assert n_star == pytest.approx(true, rel=0.01)
    # one budget (or too few points) fits nothing: 5 parameters
    assert scaling_fit(curves[:1], "fam") is None


def test_the_papers_run_is_counted_as_qkvlab_counts_compute():
    # 6N + attention per token for GPT-2 small at context 1024, times 51.6B tokens
    assert 3e19 < paper_flops() < 5e19


def test_a_sweep_at_fixed_budgets_reports_its_isoflop_curves(tmp_path, data_dir):
    import json

    from helpers import tiny_config
    from qkvlab.cli import main
    from qkvlab.run.config import save_config

    base = tiny_config(data_dir, "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                       "train.max_steps=4", "train.eval_interval=2", "train.eval_windows=4",
                       "train.ckpt_interval=100", "optim.lr=1e-3", "optim.warmup_steps=0")
    save_config(base, tmp_path / "base.toml")
    budget = 6 * base.flops_per_step  # 6 steps at d = 16: more at 8, fewer at 32
    (tmp_path / "iso.toml").write_text(f"""
[spec]
name = "iso"
base = "base.toml"
seeds = [1, 2]

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"
flop_budget = {budget}

[[variant]]
name = "baseline-iso"
family = "baseline"
rule = "baseline"
grid = {{ n_embd = [8, 32], flop_budget = [{budget}] }}

[[variant]]
name = "qid"
family = "qid"
rule = "q-identity"
grid = {{ n_embd = [8, 16, 32], flop_budget = [{budget}] }}

# each arm at d = 16 at a second lr, W_Q = I at a third (an lr scan); W_Q = I at 3e-3 meets
# the baseline at 3e-3
[[variant]]
name = "baseline-lr"
rule = "baseline"
lr = 3e-3
flop_budget = {budget}

[[variant]]
name = "qid-lr"
versus = "baseline-lr"
rule = "q-identity"
n_embd = 16
lr = 3e-3
flop_budget = {budget}

[[variant]]
name = "qid-lr3"
family = "qid-lr3"
rule = "q-identity"
lr = 1e-2
flop_budget = {budget}
""", encoding="utf-8")
    out, rep = tmp_path / "sw", tmp_path / "rep"
    assert main(["sweep", str(tmp_path / "iso.toml"), "--out", str(out)]) == 0
    assert main(["report", str(out), "--out", str(rep)]) == 0
    data = json.loads((rep / "report.json").read_text())
    text = (rep / "report.md").read_text()
    iso = data["isoflop"]
    assert [(c["family"], len(c["points"])) for c in iso["curves"]] == [
        ("baseline", 3), ("baseline-lr", 1), ("qid", 3), ("qid-lr", 1), ("qid-lr3", 1)]
    assert [p["width"] for p in iso["curves"][0]["points"]] == [8, 16, 32]
    gaps = {g["family"]: g for g in iso["gaps"]}
    gap = gaps["qid"]  # qid's minimum against the baseline's, over seed 2
    assert gap["fresh_seeds"]["seeds"] == [2] and gap["reference"] != "baseline-lr"
    assert gaps["qid-lr"]["reference"] == "baseline-lr"  # its versus, not the baseline
    assert gaps["baseline-lr"]["reference"] != "baseline-lr"  # no versus: the baseline's
    # the scan: W_Q = I at d = 16 at lr 1e-3, 3e-3 and 1e-2, read at seed 1 (the baseline's
    # two lrs are no scan)
    scans = {sc["arm"]: sc for sc in iso["lr_scans"]}
    assert set(scans) == {"qid"}
    assert [p["lr"] for p in scans["qid"]["points"]] == [1e-3, 3e-3, 1e-2]
    assert [p["family"] for p in scans["qid"]["points"]] == ["qid", "qid-lr", "qid-lr3"]
    losses = {p["lr"]: p["loss"] for p in scans["qid"]["points"]}
    assert scans["qid"]["best_lr"] == min(losses, key=losses.get)
    assert scans["qid"]["bracketed"] == (scans["qid"]["best_lr"] == 3e-3)
    assert "### The peak lr at a budget's sizes" in text and "lr 3e-3" in text
    # the single-size lr checks are drawn against their lr, not as sizes
    from qkvlab.experiments.isoflop import sized_curves
    from qkvlab.experiments.report import IsoFlop, build_report
    from qkvlab.experiments.spec import load_spec

    analysis = IsoFlop.of(build_report(load_spec(out), out))
    assert [c.family for c in sized_curves(analysis.curves, analysis.scans)] == [
        "baseline", "baseline-lr", "qid"]  # the baseline's second lr is no scan: a check
    assert (rep / "isoflop_lr.png").stat().st_size > 5_000
    assert "## IsoFLOP: the arms at equal compute" in text
    assert (rep / "isoflop.png").stat().st_size > 5_000
    assert (rep / "isoflop_gap.png").stat().st_size > 5_000
    # loss against compute and against the time each run took, measured
    assert (rep / "isoflop_frontier.png").stat().st_size > 5_000
    assert "its training time (s)" in text and "isoflop_frontier.png" in text
    # one budget tested: no line of the gap against compute, and the report says why
    assert iso["trends"] == [] and "No line of the gap against compute yet" in text
    # the answer is the minima's gaps over the fresh seeds, Holm over each family's budgets
    head = data["headline"]
    assert head["kind"] == "isoflop" and head["holm_over"] == "each family's budgets"
    assert head["figure"] == "gaps.png"  # each gap against the margin, named by its families
    assert {(c["family"], c["reference"]) for c in head["comparisons"]} == {
        (g["family"], g["reference"]) for g in iso["gaps"] if g["fresh_seeds"]}
    answer = text.split("## The answer")[1].split("\n## ")[0]
    assert "IsoFLOP minimum" in answer and f"({budget:.3g} FLOPs) vs" in answer


def test_a_group_at_another_budget_is_never_paired_across_budgets():
    from types import SimpleNamespace

    from qkvlab.experiments.results import compared_at_own_shape

    def group(family: str, budget: float | None, width: int = 64) -> SimpleNamespace:
        config = SimpleNamespace(model=SimpleNamespace(n_embd=width, n_layer=4),
                                 train=SimpleNamespace(flop_budget=budget))
        return SimpleNamespace(group=SimpleNamespace(family=family, config=config))

    ref, ref_1e13 = group("baseline", 4e13), group("baseline", 1e13)
    qid_4e13, qid_1e13 = group("qid", 4e13), group("qid", 1e13)
    lone = group("qid", 1.6e14)  # no baseline at its budget: a gap would compare budgets
    narrow = group("qid", 4e13, width=48)  # matched in parameters: the spec's comparison
    groups = [ref, ref_1e13, qid_4e13, qid_1e13, lone, narrow]
    assert not compared_at_own_shape(qid_4e13, ref, groups)
    assert compared_at_own_shape(qid_1e13, ref, groups)
    assert compared_at_own_shape(ref_1e13, ref, groups)
    assert compared_at_own_shape(lone, ref, groups)
    assert not compared_at_own_shape(narrow, ref, groups)
