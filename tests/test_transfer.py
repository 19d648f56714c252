"""The transfer table: each family's tuned setting carried to other shapes, read as holds /
fails / edge / no centre; and the report's choice of final loss (the long eval when every run
has it)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from qkvlab.experiments.report import use_loss_measure
from qkvlab.experiments.runs import RunData
from qkvlab.experiments.transfer import TOLERANCE_PCT, transfer_rows


def group(family: str, width: int, depth: int, lr: float, alpha: float, loss: float,
          param: str = "mup", wd: float = 0.1):
    model = SimpleNamespace(n_embd=width, n_layer=depth, alpha=alpha, parametrization=param)
    config = SimpleNamespace(model=model, optim=SimpleNamespace(lr=lr, weight_decay=wd))
    name = f"{family}-d{width}x{depth}-lr{lr:g}-a{alpha:g}-wd{wd:g}"
    return SimpleNamespace(group=SimpleNamespace(name=name, family=family, config=config),
                           loss=SimpleNamespace(n=1, mean=loss))


def cross(family, width, depth, centre, lr_down, lr_up, a_down, a_up, lr=1e-2, alpha=1.0):
    return [group(family, width, depth, lr, alpha, centre),
            group(family, width, depth, lr / 2, alpha, lr_down),
            group(family, width, depth, lr * 2, alpha, lr_up),
            group(family, width, depth, lr, alpha / 2, a_down),
            group(family, width, depth, lr, alpha * 2, a_up)]


def base_grid(family: str):
    """d 128 x 4: lr 5e-3 to 2e-2 x alpha 0.5 to 2, best at lr 1e-2, alpha 1 (loss 1.70)."""
    return [group(family, 128, 4, lr, a, 1.70 + 0.05 * abs(math.log2(lr / 1e-2))
                  + 0.03 * abs(math.log2(a)))
            for lr in (5e-3, 1e-2, 2e-2) for a in (0.5, 1.0, 2.0)]


def rows_of(groups):
    rep = SimpleNamespace(groups=groups)
    return {(r.family, r.width, r.depth): r for r in transfer_rows(rep)}


def test_each_shape_is_read_against_the_setting_tuned_at_the_base_shape():
    groups = base_grid("qid") + [
        *cross("qid", 256, 4, 1.60, 1.65, 1.62, 1.63, 1.61),  # the centre is best: holds
        # the best at lr x2, the centre 1% behind: fails
        *cross("qid", 512, 4, 1.5150, 1.56, 1.50, 1.53, 1.52),
        # the best at alpha x2 (0.1% ahead): within tolerance, but at the edge of what ran
        *cross("qid", 128, 8, 1.6516, 1.70, 1.68, 1.69, 1.6500),
    ]
    rows = rows_of(groups)
    base = rows[("qid", 128, 4)]
    assert base.base and base.optimum.lr == 1e-2 and base.optimum.alpha == 1.0
    assert len(base.cells) == 9 and base.centre_gap_pct == 0.0
    holds = rows[("qid", 256, 4)]
    assert holds.verdict == "holds" and holds.centre is holds.best
    assert (holds.lr_steps, holds.alpha_steps) == (0.0, 0.0)
    fails = rows[("qid", 512, 4)]
    assert fails.verdict == "fails" and fails.lr_steps == pytest.approx(1.0)
    assert fails.centre_gap_pct == pytest.approx(100 * (1.515 / 1.50 - 1))
    assert fails.centre_gap_pct > TOLERANCE_PCT
    edge = rows[("qid", 128, 8)]
    assert edge.alpha_steps == pytest.approx(1.0) and not edge.bracketed
    assert edge.verdict == "edge" and 0 < edge.centre_gap_pct < TOLERANCE_PCT
    # the base shape comes first, then the others by width and depth
    assert [(r.width, r.depth) for r in transfer_rows(SimpleNamespace(groups=groups))] == [
        (128, 4), (128, 8), (256, 4), (512, 4)]


def test_a_shape_without_the_carried_setting_has_no_verdict_but_its_best():
    groups = base_grid("base") + [group("base", 256, 4, 4e-3, 1.0, 1.8),
                                  group("base", 256, 4, 2e-3, 1.0, 1.9)]
    row = rows_of(groups)[("base", 256, 4)]
    assert row.centre is None and row.verdict == "no centre"
    assert row.lr_steps == pytest.approx(math.log2(0.4)) and row.best.loss == 1.8


def test_the_carried_setting_includes_its_weight_decay():
    groups = base_grid("base") + [group("base", 256, 4, 1e-2, 1.0, 1.50, wd=0.03125),
                                  group("base", 256, 4, 1e-2, 1.0, 1.60)]
    row = rows_of(groups)[("base", 256, 4)]
    assert row.centre.loss == 1.60 and row.centre.weight_decay == 0.1  # the base's decay
    assert row.best.loss == 1.50 and row.verdict == "fails"


def test_an_optimum_two_steps_away_fails_even_within_tolerance():
    groups = base_grid("base") + [group("base", 256, 4, 1e-2, 1.0, 1.6010),
                                  group("base", 256, 4, 4e-2, 1.0, 1.6000),
                                  group("base", 256, 4, 8e-2, 1.0, 1.7)]
    row = rows_of(groups)[("base", 256, 4)]
    assert row.lr_steps == pytest.approx(2.0) and row.verdict == "fails"


def test_one_shape_or_an_untuned_base_makes_no_transfer_table():
    assert transfer_rows(SimpleNamespace(groups=base_grid("base"))) == []
    probe = [group("probe", 128, 4, 1e-2, 1.0, 1.7), group("probe", 256, 4, 1e-2, 1.0, 1.6)]
    assert transfer_rows(SimpleNamespace(groups=probe)) == []


def test_a_shape_that_ran_only_the_carried_setting_is_not_judged():
    row = rows_of(base_grid("base") + [group("base", 256, 4, 1e-2, 1.0, 1.6)])[
        ("base", 256, 4)]
    assert row.centre is row.best and row.verdict == "one cell"


def _run(status: str, windows: float | None, long: float | None) -> RunData:
    r = RunData("g", 1, Path("g/seed-1"), status, 10)
    r.final_loss = r.final_loss_windows = windows
    r.final_loss_long = long
    return r


def test_the_report_compares_the_long_loss_only_when_every_finished_run_has_it():
    runs = [_run("done", 2.0, 1.9), _run("done", 2.1, 2.05), _run("failed", None, None)]
    assert use_loss_measure(runs) == "long"
    assert [r.final_loss for r in runs] == [1.9, 2.05, None]
    mixed = [_run("done", 2.0, 1.9), _run("done", 2.1, None)]
    assert use_loss_measure(mixed) == "windows"
    assert [r.final_loss for r in mixed] == [2.0, 2.1]  # no pair mixes the two


def test_a_sweep_over_two_widths_reports_the_transfer_table(tmp_path, data_dir):
    from test_stats_report import sweep_report

    data, text, rep = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "baseline-lr"
family = "baseline"
rule = "baseline"
grid = { lr = [5e-4, 2e-3, 4e-3] }

[[variant]]
name = "baseline-wide"
family = "baseline"
rule = "baseline"
n_embd = 32
grid = { lr = [5e-4, 1e-3, 2e-3, 4e-3] }
""")
    rows = {(r["family"], r["width"]): r for r in data["transfer"]}
    assert set(rows) == {("baseline", 16), ("baseline", 32)}  # qid ran at one shape
    base, wide = rows[("baseline", 16)], rows[("baseline", 32)]
    assert base["base"] and base["cells"] == 4 and not wide["base"]
    assert wide["centre"]["lr"] == base["best"]["lr"]
    assert wide["verdict"] in ("holds", "fails", "edge")
    assert "## Transfer from the tuned shape" in text and "(tuned)" in text
    assert data["loss_measure"] in ("long", "windows")
    assert ((rep / "transfer.png").stat().st_size > 5_000) == ("transfer" in data["figures"])
