"""Holm's adjustment and the sign-test floor that every sweep report states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
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


SPEC_HEAD = """
[spec]
name = "trend"
base = "base.toml"
seeds = [1, 2]

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"

[[variant]]
name = "qid"
rule = "q-identity"
"""


def sweep_report(tmp_path, data_dir, variants: str, *report_args: str
                 ) -> tuple[dict, str, Path]:
    """A 2-seed, 4-step sweep of SPEC_HEAD's two variants plus `variants`, and its report:
    (report.json, report.md, the report folder)."""
    from helpers import tiny_config
    from qkvlab.cli import main
    from qkvlab.run.config import save_config

    save_config(tiny_config(data_dir, "model.n_layer=1", "model.n_embd=16", "train.max_steps=4",
                            "train.eval_interval=2", "train.eval_windows=4",
                            "train.ckpt_interval=4", "optim.lr=1e-3"), tmp_path / "base.toml")
    spec = tmp_path / "trend.toml"
    spec.write_text(SPEC_HEAD + variants, encoding="utf-8")
    out, rep = tmp_path / "sw", tmp_path / "rep"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert main(["report", str(out), "--out", str(rep), *report_args]) == 0
    return json.loads((rep / "report.json").read_text()), (rep / "report.md").read_text(), rep


def test_a_sweep_over_widths_reports_the_gap_against_width(tmp_path, data_dir):
    data, text, rep = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "baseline-wide"
family = "baseline"
rule = "baseline"
n_embd = 32

[[variant]]
name = "qid-wide"
family = "qid"
rule = "q-identity"
n_embd = 32

[[variant]]
name = "qid-narrow"
family = "qid-narrow"
rule = "q-identity"
n_embd = 12
""")
    gaps = {(g["family"], g["width"]): g for g in data["width_gaps"]}
    assert set(gaps) == {("qid", 16), ("qid", 32)}
    assert gaps[("qid", 32)]["reference"] == "baseline-wide"  # its own width's baseline
    assert gaps[("qid", 16)]["reference"] == "baseline" and gaps[("qid", 16)]["n"] == 2
    assert "## Gap to the baseline against width" in text and "gap_vs_width.png" in text
    assert (rep / "gap_vs_width.png").stat().st_size > 5_000
    # the early-stopping view: each run's lowest validation loss, paired with its own width's
    best = {(r["group"], r["seed"]): r["best_val_loss"] for r in data["runs"]}
    diffs = [best[("qid-wide", s)] - best[("baseline-wide", s)] for s in (1, 2)]
    ref = (best[("baseline-wide", 1)] + best[("baseline-wide", 2)]) / 2
    wide = gaps[("qid", 32)]
    assert wide["best_val"]["relative_pct"] == pytest.approx(100 * sum(diffs) / 2 / ref)
    assert wide["train"]["n"] == 2 and "| best | 95% CI | train | 95% CI |" in text
    keys = sorted(gaps)  # p adjusted over the table's two rows
    assert [gaps[k]["p_holm"] for k in keys] == pytest.approx(holm([gaps[k]["p"] for k in keys]))
    assert "p (Holm)" in text and "sign test over 2 seeds cannot go below p = 0.5" in text
    # the spec's reference is at d = 16: the d = 32 groups get no gap to it, anywhere
    groups = {g["group"]: g for g in data["groups"]}
    assert groups["qid"]["paired_vs_baseline"]["n"] == 2
    assert groups["qid-wide"]["paired_vs_baseline"] is None
    assert groups["baseline-wide"]["paired_vs_baseline"] is None
    fit = {row["group"]: row for row in data["fit"]}
    assert fit["qid-wide"]["train_vs_reference"] is None and fit["qid"]["train_vs_reference"]
    # a narrower model with no baseline of its width (matched in parameters, say) is paired
    assert groups["qid-narrow"]["paired_vs_baseline"]["n"] == 2
    assert set(data["gap_over_training"]["relative_pct"]) == {"qid", "qid-narrow"}
    paired = text.split("## Paired differences")[1].split("\n## ")[0]
    assert "| qid |" in paired and "qid-wide" not in paired
    assert "2 group(s) at another width, depth or budget than the baseline (d = 16, 1 layers) " \
        "are not paired with it here" in text


def test_a_sweep_over_learning_rates_pairs_each_group_with_the_baseline_at_its_lr(
        tmp_path, data_dir):
    data, text, rep = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "baseline-lr"
family = "baseline"
rule = "baseline"
grid = { lr = [0.004] }

[[variant]]
name = "qid-lr"
family = "qid"
rule = "q-identity"
grid = { lr = [0.004] }
""")
    assert data["width_gaps"] == []  # one width: no width trend
    gaps = {(g["family"], g["lr"]): g for g in data["lr_gaps"]}
    assert set(gaps) == {("qid", 0.001), ("qid", 0.004)}
    assert gaps[("qid", 0.004)]["reference"] == "baseline-lr.lr0.004"  # the baseline at its lr
    assert gaps[("qid", 0.001)]["reference"] == "baseline" and gaps[("qid", 0.001)]["n"] == 2
    assert "## Gap to the baseline against lr" in text and "gap_vs_lr.png" in text
    assert "against width" not in text
    assert (rep / "gap_vs_lr.png").stat().st_size > 5_000

    # the gap over training: per seed 100 (L - L_base) / L_base at each evaluated step, averaged
    gap = data["gap_over_training"]
    assert gap["steps"] == [2, 4] and "## The gap over training" in text
    # (on the periodic evals' curve: its last point is the windows' final loss, whichever
    # final loss the report compares)
    runs = {(r["group"], r["seed"]): r["final_val_loss_windows"] for r in data["runs"]}
    want = sum(100 * (runs[("qid", s)] - runs[("baseline", s)]) / runs[("baseline", s)]
               for s in (1, 2)) / 2
    assert gap["relative_pct"]["qid"][-1] == pytest.approx(want)
    assert set(gap["relative_pct"]) == {"baseline-lr.lr0.004", "qid", "qid-lr.lr0.004"}

    # fit: the training loss logged after 90% of the steps and the best validation loss, paired
    def tail(group, seed):
        rows = [json.loads(line) for line in
                (tmp_path / "sw" / group / f"seed-{seed}" / "metrics.jsonl").open()]
        losses = [r["loss"] for r in rows if "loss" in r and r["step"] > 0.9 * 4]
        return sum(losses) / len(losses)

    fit = {row["group"]: row for row in data["fit"]}
    assert fit["qid"]["train_loss_tail"] == pytest.approx((tail("qid", 1) + tail("qid", 2)) / 2)
    d = [tail("qid", s) - tail("baseline", s) for s in (1, 2)]
    ref = (tail("baseline", 1) + tail("baseline", 2)) / 2
    assert fit["qid"]["train_vs_reference"]["relative_pct"] == pytest.approx(50 * sum(d) / ref)
    assert fit["baseline"]["train_vs_reference"] is None
    assert all(r["best_val_loss"] <= r["final_val_loss_windows"] for r in data["runs"])
    # every run has the long final eval, so the report compares it
    assert data["loss_measure"] == "long"
    for r in data["runs"]:
        summary = json.loads((tmp_path / "sw" / r["run_dir"] / "summary.json").read_text())
        assert r["final_val_loss"] == summary["final_val_loss_long"]["loss"]
    assert "## Fit and generalisation" in text

    # tuned: each family at the lr of its lowest mean final loss, against the baseline's best
    runs = {(r["group"], r["seed"]): r["final_val_loss"] for r in data["runs"]}

    def best_group(*groups):
        return min(groups, key=lambda g: runs[(g, 1)] + runs[(g, 2)])

    qid, base = best_group("qid", "qid-lr.lr0.004"), best_group("baseline", "baseline-lr.lr0.004")
    (tuned,) = data["lr_tuned_gaps"]
    assert (tuned["group"], tuned["reference"]) == (qid, base) and tuned["at_edge"]
    d = [runs[(qid, s)] - runs[(base, s)] for s in (1, 2)]
    ref = (runs[(base, 1)] + runs[(base, 2)]) / 2
    assert tuned["relative_pct"] == pytest.approx(50 * sum(d) / ref)
    assert "## Each family at its own best lr" in text and "optimum may lie beyond" in text
    findings = text.split("## What the data shows")[1].split("## Variants")[0]
    (line,) = [ln for ln in findings.splitlines() if "at its own best lr" in ln]
    assert line.startswith("- Each family at its own best lr (d = ") and "**qid** at lr" in line
    assert f"{tuned['relative_pct']:+.3f}%" in line and "over 2 seeds" in line
    assert "end of the values run" in line  # tuned["at_edge"]
    assert f" | 0.5 | {qid} | " in text and f" | 1 | {base} | " in text  # the alphas (paper: 0.5)
    assert "width_tuned_gaps" not in data  # a width is not tuned per model


def test_attention_statistics_are_measured_cached_and_archived(tmp_path, data_dir):
    from qkvlab.cli import main
    from qkvlab.run.load import load_model, open_data
    from qkvlab.theory.scale import attention_stats

    data, text, _ = sweep_report(tmp_path, data_dir, "", "--attention")
    run = tmp_path / "sw" / "qid" / "seed-1"
    cached = json.loads((run / "attention_stats.json").read_text())
    assert cached["step"] == 4 and cached["windows"] == 16 and len(cached["layers"]) == 1
    # the cache holds attention_stats of the final checkpoint on the first 16 val windows
    model, ckpt = load_model(run, torch.device("cpu"))
    x, _ = open_data(ckpt.config.data).val_windows(16, ckpt.config.model.block_size)
    (layer,) = attention_stats(model.float(), x)
    assert cached["layers"][0] == pytest.approx(layer)
    rows = data["attention"]
    assert set(rows) == {"baseline", "qid"} and rows["qid"]["seeds"] == [1, 2]
    seed2 = json.loads((tmp_path / "sw" / "qid" / "seed-2" / "attention_stats.json").read_text())
    assert rows["qid"]["entropy"][0] == pytest.approx(
        (cached["layers"][0]["entropy"] + seed2["layers"][0]["entropy"]) / 2)
    assert "## Attention after training" in text and "logit std L1" in text
    # archived without checkpoints, the cache stands in
    assert main(["archive", str(tmp_path / "sw"), str(tmp_path / "arch")]) == 0
    assert main(["report", str(tmp_path / "arch"), "--out", str(tmp_path / "rep2"),
                 "--attention"]) == 0
    again = json.loads((tmp_path / "rep2" / "report.json").read_text())
    assert again["attention"] == rows


def test_archive_measures_the_attention_that_its_copy_could_not(tmp_path, data_dir, capsys):
    """Archived before any `report --attention`, the copy still reports every run's attention:
    the archive measures it from each final checkpoint on the way out. Without the data to
    measure on, it stops with one line and writes nothing."""
    import shutil

    from qkvlab.cli import main

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    sweep_report(tmp_path, data, "")  # a report without --attention measures nothing
    sw, arch = tmp_path / "sw", tmp_path / "arch"
    assert not list(sw.rglob("attention_stats.json"))
    assert main(["archive", str(sw), str(tmp_path / "bare"), "--no-attention"]) == 0
    assert not list((tmp_path / "bare").rglob("attention_stats.json"))

    data.rename(tmp_path / "gone")
    capsys.readouterr()
    assert main(["archive", str(sw), str(arch)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no prepared data at" in err and "qkvlab prepare" in err and len(err.splitlines()) == 1
    assert not arch.exists()

    (tmp_path / "gone").rename(data)
    assert main(["archive", str(sw), str(arch)]) == 0
    assert len(list(arch.rglob("attention_stats.json"))) == 4  # 2 variants x 2 seeds
    reports = {}
    for name, folder in (("sweep", sw), ("archive", arch)):
        assert main(["report", str(folder), "--out", str(tmp_path / name), "--attention"]) == 0
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())["attention"]
    assert set(reports["archive"]) == {"baseline", "qid"}
    assert reports["archive"] == reports["sweep"]


def test_the_lr_table_has_a_row_per_family_and_width_with_the_best_group_at_each_lr(
        tmp_path, data_dir):
    """An alpha scan at one lr and a second width: each cell is its row's best group there."""
    import math

    data, text, _ = sweep_report(tmp_path, data_dir, "".join(
        f'[[variant]]\nname = "{name}"\nfamily = "{fam}"\nrule = "{rule}"\n{extra}\n'
        for name, fam, rule, extra in (
            ("baseline-lr", "baseline", "baseline", "lr = 0.004"),
            ("baseline-a", "baseline", "baseline", "attn_scale = 0.7"),
            ("qid-lr", "qid", "q-identity", "lr = 0.004"),
            ("baseline-wide", "baseline", "baseline", "n_embd = 32"),
            ("baseline-wide-lr", "baseline", "baseline", "n_embd = 32\nlr = 0.004"))))
    mean = {g["group"]: g["final_val_loss"]["mean"] for g in data["groups"]}
    alpha = {g["group"]: g["attn_scale"] for g in data["groups"]}
    table = text.split("## Final loss vs learning rate")[1].split("![")[0]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| family")}
    assert set(rows) == {"baseline d 16", "qid d 16", "baseline d 32"}
    best = min(("baseline", "baseline-a"), key=mean.get)  # the scan at lr 1e-3
    cell = rows["baseline d 16"][0]
    assert cell.startswith(f"{mean[best]:.4f}")
    shown = best == "baseline-a"  # its alpha differs from the lr 4e-3 cell's: named
    assert ("alpha" in cell) == shown
    if shown:
        assert f"alpha {alpha[best] * math.sqrt(8):.3g}" in cell
    assert rows["baseline d 32"][1].startswith(f"{mean['baseline-wide-lr']:.4f}")
    assert "alpha" not in "".join(rows["qid d 16"])
    # final_vs_lr.png's right panel: W_Q = I against the baseline's best cell at the same lr
    # and width; the baseline's own rows and the d = 32 row (no W_Q = I there) have no gaps
    gaps = data["lr_grid_gaps"]
    assert set(gaps) == {"qid d 16"}
    by_lr = {w["lr"]: w for w in gaps["qid d 16"]}
    assert set(by_lr) == {0.001, 0.004}
    assert by_lr[0.001]["group"] == "qid" and by_lr[0.001]["reference"] == best
    assert (by_lr[0.004]["group"], by_lr[0.004]["reference"]) == ("qid-lr", "baseline-lr")
    pct = 100 * (mean["qid-lr"] - mean["baseline-lr"]) / mean["baseline-lr"]
    assert by_lr[0.004]["relative_pct"] == pytest.approx(pct)
    # the lr trend pairs qid-lr alone: at lr 1e-3 and d = 16 the baseline ran two alphas
    assert [(w["group"], w["reference"]) for w in data["lr_gaps"]] == [("qid-lr", "baseline-lr")]
    trend = text.split("## Gap to the baseline against lr")[1].split("\n## ")[0]
    assert "The 1 setting(s) where the baseline family ran several groups" in trend


QID_SCAN = """
[[variant]]
name = "qid-a"
family = "qid"
rule = "q-identity"
grid = { attn_scale = [0.1, 0.7] }
"""  # W_Q = I's scan at d = 16, two alphas


def test_a_scale_scan_reports_each_arms_best_alpha_and_the_tuned_gap(tmp_path, data_dir):
    """Both arms scan attn_scale at two widths (n_embd 16: 2 heads of 8; 32: 2 heads of 16)."""
    import math

    data, text, rep = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "baseline-a"
family = "baseline"
rule = "baseline"
grid = { attn_scale = [0.7, 2.0] }
""" + QID_SCAN + """
[[variant]]
name = "baseline-wide"
family = "baseline"
rule = "baseline"
n_embd = 32
grid = { attn_scale = [0.1, 0.7] }

[[variant]]
name = "qid-wide"
family = "qid"
rule = "q-identity"
n_embd = 32
grid = { attn_scale = [0.1, 0.7] }

[[variant]]
name = "vid-wide"
family = "vid"
rule = "v-identity"
n_embd = 32
attn_scale = 0.7
""")
    runs = {(r["group"], r["seed"]): r["final_val_loss"] for r in data["runs"]}
    mean = {g: (runs[(g, 1)] + runs[(g, 2)]) / 2 for g, _ in runs}
    cells = {(c["family"], c["width"]): c for c in data["scale_scan"]}
    assert set(cells) == {("baseline", 16), ("qid", 16), ("baseline", 32), ("qid", 32)}
    # d = 16: the spec's own baseline (the standard scale, 1/sqrt(8)) joins the baseline scan
    base16 = {round(p["alpha"], 6): p["group"] for p in cells[("baseline", 16)]["points"]}
    assert sorted(base16) == [1.0, round(0.7 * math.sqrt(8), 6), round(2.0 * math.sqrt(8), 6)]
    for cell in cells.values():
        groups = [p["group"] for p in cell["points"]]
        best = min(groups, key=mean.get)
        assert [p["group"] for p in cell["points"] if p["alpha"] == cell["best_alpha"]] == [best]
        assert cell["best_at_edge"] == (best in (groups[0], groups[-1]))
        assert (cell["fitted_alpha"] is None) == cell["best_at_edge"]  # bracketed: fitted
    tuned = {(t["family"], t["width"]): t for t in data["scale_tuned_gaps"]}
    assert set(tuned) == {("qid", 16), ("qid", 32), ("vid", 32)}
    assert ("vid", 32) not in cells  # one alpha is no scan, but it is paired with the tuned one
    v = tuned[("vid", 32)]
    assert not v["scanned"] and tuned[("qid", 32)]["scanned"]
    assert (v["group"], v["reference"]) == ("vid-wide", tuned[("qid", 32)]["reference"])
    diffs = [runs[("vid-wide", s)] - runs[(v["reference"], s)] for s in (1, 2)]
    ref = (runs[(v["reference"], 1)] + runs[(v["reference"], 2)]) / 2
    assert v["relative_pct"] == pytest.approx(50 * sum(diffs) / ref)
    assert f"| vid | 32 | 0.001 | {0.7 * 4:.3g} (one alpha) |" in text  # 2 heads of 16
    t = tuned[("qid", 32)]
    want = [runs[(t["group"], s)] - runs[(t["reference"], s)] for s in (1, 2)]
    ref = (runs[(t["reference"], 1)] + runs[(t["reference"], 2)]) / 2
    assert t["relative_pct"] == pytest.approx(50 * sum(want) / ref)
    assert t["alpha"] == cells[("qid", 32)]["best_alpha"]
    assert t["reference_alpha"] == cells[("baseline", 32)]["best_alpha"]
    # every alpha (2 seeds each here) against the baseline's best at its width, but that best
    fixed = {(a["group"], a["width"]): a for a in data["scale_alpha_gaps"]}
    refs = {w: tuned[("qid", w)]["reference"] for w in (16, 32)}
    every = {(p["group"], w) for (_, w), c in cells.items() for p in c["points"]}
    assert set(fixed) == every - {(refs[16], 16), (refs[32], 32)}
    for (g, w), a in fixed.items():
        want = [runs[(g, s)] - runs[(refs[w], s)] for s in (1, 2)]
        ref = (runs[(refs[w], 1)] + runs[(refs[w], 2)]) / 2
        assert a["reference"] == refs[w]
        assert a["relative_pct"] == pytest.approx(50 * sum(want) / ref)
    assert "### Each alpha run on several seeds against baseline at its best" in text
    # one seed gives no interval: an alpha left with one seed is not paired
    import shutil

    from qkvlab.cli import main

    lone = next(g for g, w in fixed if w == 32 and g.startswith("qid"))
    shutil.rmtree(tmp_path / "sw" / lone / "seed-2")
    assert main(["report", str(tmp_path / "sw"), "--out", str(tmp_path / "rep2")]) == 0
    again = json.loads((tmp_path / "rep2" / "report.json").read_text())
    assert {a["group"] for a in again["scale_alpha_gaps"]} == {g for g, _ in fixed} - {lone}
    assert "## The attention scale" in text and "Each arm at its own best alpha" in text
    assert "| best alpha | fitted |" in text
    assert "| family | d | lr | alpha | baseline alpha |" in text
    # several baseline groups per width (the scan): the scan pairs them, not the width or lr trend
    assert data["width_gaps"] == [] and data["lr_tuned_gaps"] == []
    assert "## Each family at its own best lr" not in text
    assert (rep / "scale_scan.png").stat().st_size > 5_000
    assert (rep / "tuned_gap_vs_width.png").stat().st_size > 5_000


def test_a_named_rule_is_paired_with_the_baseline_under_the_same_rule(tmp_path, data_dir):
    """A held-out width (32) where both arms run the "fitted" rule beside a scan at 16: each
    side at the alpha the rule gives its shape, paired by seed."""
    import math

    from qkvlab.model.scale import attention_scale

    data, text, _ = sweep_report(tmp_path, data_dir, QID_SCAN + """
[[variant]]
name = "baseline-held"
family = "baseline"
rule = "baseline"
n_embd = 32
attn_scale = "fitted"

[[variant]]
name = "qid-held"
family = "qid"
rule = "q-identity"
n_embd = 32
attn_scale = "fitted"
""")
    runs = {(r["group"], r["seed"]): r["final_val_loss"] for r in data["runs"]}
    (r,) = [g for g in data["scale_rule_gaps"] if g["rule"] == "fitted"]
    assert (r["family"], r["width"], r["group"], r["reference"]) == (
        "qid", 32, "qid-held", "baseline-held")
    d_k = 16  # 2 heads of 16
    for key, projection in (("alpha", "q-identity"), ("reference_alpha", "baseline")):
        want = attention_scale("fitted", projection, 32, d_k, 0.02) * math.sqrt(d_k)
        assert r[key] == pytest.approx(want)
    diffs = [runs[("qid-held", s)] - runs[("baseline-held", s)] for s in (1, 2)]
    ref = (runs[("baseline-held", 1)] + runs[("baseline-held", 2)]) / 2
    assert r["relative_pct"] == pytest.approx(50 * sum(diffs) / ref)
    # the spec's own pair at d = 16 runs two rules (the baseline the default "standard", W_Q = I
    # its rule's "paper"): not a pair under one rule
    assert {(g["rule"], g["width"]) for g in data["scale_rule_gaps"]} == {("fitted", 32)}
    assert "### Named scale rules against baseline under the same rule" in text
    assert "| fitted | qid | 32 |" in text


def test_a_scan_picks_each_best_alpha_on_the_seeds_all_its_alphas_share(tmp_path, data_dir):
    """Seeds added to some alphas later (stage 2) measure the best alpha; they do not pick it."""
    import shutil

    from qkvlab.cli import main

    data, _, _ = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "qid-a"
family = "qid"
rule = "q-identity"
grid = { attn_scale = [0.1, 0.7, 2.0] }
""")
    runs = {(r["group"], r["seed"]): r["final_val_loss"] for r in data["runs"]}
    qid = [g for g, s in runs if s == 1 and g.startswith("qid-a")]
    shutil.rmtree(tmp_path / "sw" / qid[0] / "seed-2")  # one alpha lacks seed 2
    assert main(["report", str(tmp_path / "sw"), "--out", str(tmp_path / "rep3")]) == 0
    again = json.loads((tmp_path / "rep3" / "report.json").read_text())
    cell = next(c for c in again["scale_scan"] if c["family"] == "qid")
    by_seed1 = min(qid, key=lambda g: runs[(g, 1)])
    assert [p["alpha"] for p in cell["points"] if p["group"] == by_seed1] == [cell["best_alpha"]]
    for p in cell["points"]:
        assert p["choice"] == pytest.approx(runs[(p["group"], 1)])
        two = p["group"] != qid[0]
        assert p["seeds"] == (2 if two else 1)
        want = (runs[(p["group"], 1)] + runs[(p["group"], 2)]) / 2 if two else runs[(p["group"], 1)]
        assert p["final"] == pytest.approx(want)


def test_variants_without_a_paired_seed_share_one_line_and_leave_the_paired_table(
        tmp_path, data_dir):
    """A scan in progress: the unfinished variants are named once, not given a row each."""
    import shutil

    from qkvlab.cli import main

    sweep_report(tmp_path, data_dir, """
[[variant]]
name = "qid-late"
family = "qid"
rule = "q-identity"
grid = { attn_scale = [0.1, 0.7] }
""")
    for group in ("qid-late.scale0.1", "qid-late.scale0.7"):
        shutil.rmtree(tmp_path / "sw" / group)
    assert main(["report", str(tmp_path / "sw"), "--out", str(tmp_path / "rep2")]) == 0
    text = (tmp_path / "rep2" / "report.md").read_text()
    assert ("- 2 variant(s) have no seed finished beside the baseline yet: qid-late.scale0.1, "
            "qid-late.scale0.7.") in text
    assert "- qid: " in text and "| qid | 2 (1, 2) |" in text
    assert "| qid-late" not in text.split("## Paired differences")[1].split("## ")[0]
    # a reference with no finished run: one line that says so, not every variant by name
    shutil.rmtree(tmp_path / "sw" / "baseline")
    assert main(["report", str(tmp_path / "sw"), "--out", str(tmp_path / "rep3")]) == 0
    text = (tmp_path / "rep3" / "report.md").read_text()
    assert "- the baseline has no finished run yet, so no variant is paired with it" in text
    assert "beside the baseline yet" not in text
