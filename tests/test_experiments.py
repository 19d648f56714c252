"""Experiment specs, `qkvlab sweep` (skip, resume after a kill, refusals) and `qkvlab report`
(statistics checked against a direct computation from the run files)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sst

from helpers import refused, tiny_config
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.experiments import sweep as sweep_mod
from qkvlab.experiments.spec import config_identity, load_spec, parse_spec, spec_names
from qkvlab.experiments.stats import paired_t, summarize
from qkvlab.model.config import ModelConfig
from qkvlab.model.params import count_params
from qkvlab.model.variants import PAPER_SHAPE, derive, paper_variants
from qkvlab.run import lock as run_lock
from qkvlab.run.config import load_config, save_config
from qkvlab.run.device import device_type
from qkvlab.run.metrics import read_metrics
from qkvlab.train import trainer


def tiny_base(data_dir: Path, folder: Path) -> Path:
    """A 2 x 32 model (2 heads of 16), context 16, batch 4, 8 steps: milliseconds per step."""
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    cfg = tiny_config(data_dir, vocab=vocab + 1)
    folder.mkdir(parents=True, exist_ok=True)
    return save_config(cfg, folder / "base.toml")


SPEC = """
[spec]
name = "{name}"
base = "base.toml"
seeds = [1, 2]

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"

[[variant]]
name = "q-identity"
rule = "q-identity"
{extra}
"""


def write_spec(folder: Path, data_dir: Path, name: str = "tiny", extra: str = "") -> Path:
    tiny_base(data_dir, folder)
    path = folder / f"{name}.toml"
    path.write_text(SPEC.format(name=name, extra=extra), encoding="utf-8")
    return path


def final_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir)
            if r.get("val_loss") is not None}


# ---- specs ---------------------------------------------------------------------------------
def parse(text: str):
    import tomllib

    return parse_spec(tomllib.loads(text), "test")


@pytest.mark.parametrize("variant, needle", [
    ('name = "v"\nbaseline = true\nwidth = 3', "unknown field(s) width; valid fields: name"),
    ('name = "v"\nbaseline = true\nrule = "wider"', "unknown rule 'wider'; valid rules: baseline"),
    ('name = "v"\nbaseline = true\ngrid = { lr = [1e-3] }', "is the baseline and has a grid"),
    ('name = "v"\nbaseline = true\ngrid = { depth = [1] }', None),
    ('name = "v w"\nbaseline = true', "must be a plain name"),
    ('name = "v"\nbaseline = "yes"', "must be true or false"),
    ('name = "v"\nbaseline = true\nlr = 1e-3\ngrid = { lr = [1e-3] }', None),
])
def test_variant_fields_are_checked(variant, needle):
    with pytest.raises(QkvlabError) as err:
        parse(f'[spec]\nname = "s"\nbase = "compare-quick"\n[[variant]]\n{variant}\n')
    if needle:
        assert needle in str(err.value)


@pytest.mark.parametrize("text, needle", [
    ('[spec]\nname = "s"\nbase = "b"\n', "has no [[variant]]"),
    ('[spec]\nname = "s"\nbase = "b"\n[[variant]]\nname = "a"\n', "found none"),
    ('[spec]\nname = "s"\nbase = "b"\n[[variant]]\nname = "a"\nbaseline = true\n'
     '[[variant]]\nname = "a"\n', "used twice"),
    ('[spec]\nname = "s"\nbase = "b"\nseeds = [1, 1]\n[[variant]]\nname = "a"\n'
     'baseline = true\n', "lists a seed twice"),
    ('[spec]\nname = "s"\nbase = "b"\nwhat = 1\n', "unknown field(s) what"),
    ('[spec]\nname = "s"\n[[variant]]\nname = "a"\nbaseline = true\n', "has no base"),
    ('[specs]\nname = "s"\n', "unknown field(s) specs"),
    ('[spec]\nname = "s"\nbase = "b"\n[[variant]]\nname = "a"\nbaseline = true\n'
     '[[variant]]\nname = "q"\nversus = "lr-check"\n', "not a family of the spec"),
    ('[spec]\nname = "s"\nbase = "b"\n[[variant]]\nname = "a"\nbaseline = true\n'
     '[[variant]]\nname = "q"\nversus = "q"\n', "versus = its own family"),
    ('[spec]\nname = "s"\nbase = "b"\n[[variant]]\nname = "a"\nbaseline = true\n'
     '[[variant]]\nname = "a2"\nfamily = "b2"\n[[variant]]\nname = "q"\nfamily = "f"\n'
     'versus = "b2"\n[[variant]]\nname = "q2"\nfamily = "f"\n', "give its variants one"),
])
def test_spec_errors(text, needle):
    with pytest.raises(QkvlabError) as err:
        parse(text)
    assert needle in str(err.value)


def test_bad_variant_values_are_refused_when_resolved():
    spec = parse('[spec]\nname = "s"\nbase = "compare-quick"\n[[variant]]\nname = "a"\n'
                 'baseline = true\nprojection = "q-maybe"\n')
    with pytest.raises(QkvlabError, match="variant a.*projection='q-maybe'"):
        spec.groups()


def test_a_size_rule_derives_from_the_variants_own_shape_and_its_fields_win():
    spec = parse('[spec]\nname = "s"\nbase = "compare-quick"\n'
                 '[[variant]]\nname = "a"\nbaseline = true\nrule = "baseline"\n'
                 '[[variant]]\nname = "w"\nrule = "q-identity-wide"\nn_embd = 256\n'
                 'n_head = 4\nattn_scale = "1/sqrt(d_k)"\nweight_decay = 0.1\n'
                 'grid = { n_layer = [2, 3] }\n')
    wide = [g.config for g in spec.groups() if g.family == "w"]
    assert [c.model.n_layer for c in wide] == [2, 3]
    for cfg in wide:
        m = cfg.model
        # the d^2 per layer W_Q = I saves at d = 256 (not at the base's width) goes to the MLP
        assert (m.n_embd, m.hidden, m.projection) == (256, 4 * 256 + 128, "q-identity")
        assert m.alpha == pytest.approx(1.0) and cfg.optim.weight_decay == 0.1


# docs/paper.md section 5, written out: query, MLP hidden, d, scale, weight decay, total params
PAPER_TABLE = {
    "baseline": ("baseline", 3072, 768, 1 / 8, 0.1, 124_373_760),
    "q-identity": ("q-identity", 3072, 768, 1 / 16, 2**-5, 117_295_872),
    "q-identity-wide": ("q-identity", 3456, 768, 1 / 16, 2**-5, 124_373_760),
    "smaller-mlp": ("baseline", 2688, 768, 1 / 8, 0.1, 117_295_872),
    "narrower": ("baseline", 2976, 744, 1 / math.sqrt(62), 0.1, 117_915_816),
}


def test_rules_give_the_paper_variants_exactly():
    base = ModelConfig(**PAPER_SHAPE)
    variants = paper_variants()
    assert [v.name for v in variants] == list(PAPER_TABLE)
    for v in variants:
        d = derive(base, v.name)
        assert d.model == v.model and d.weight_decay == v.weight_decay
        m = d.model
        query, hidden, width, scale, weight_decay, total = PAPER_TABLE[v.name]
        assert (m.projection, m.hidden, m.n_embd, d.weight_decay) == (query, hidden, width,
                                                                     weight_decay), v.name
        assert m.scale == pytest.approx(scale, rel=1e-12), v.name
        assert count_params(m).total == total, v.name
        assert (m.n_layer, m.n_head, m.block_size, m.vocab_size) == (12, 12, 1024, 50304)


def test_paper_specs_are_section_5():
    spec = load_spec("paper-gpt2-small")
    groups = spec.groups()
    paper = {v.name: v for v in paper_variants()}
    assert [g.name for g in groups] == list(paper)
    for g in groups:
        # a group's kernel is the one its runs get on this machine
        assert g.config.model == paper[g.name].model.on_device(device_type("auto"), "bf16")
        assert g.config.optim.weight_decay == paper[g.name].weight_decay
        c = g.config
        assert c.tokens_per_step == 491_520 and c.train.max_steps == 105_000
        assert (c.optim.lr, c.optim.min_lr, c.optim.warmup_steps) == (6e-4, 6e-5, 2000)
        assert (c.optim.beta1, c.optim.beta2, c.train.dtype) == (0.9, 0.95, "bf16")
        assert c.decay_steps == 600_000 and c.data.tokenizer == "gpt2"
    cosine = load_spec("paper-gpt2-small-cosine").groups()
    assert all(g.config.decay_steps == g.config.train.max_steps == 105_000 for g in cosine)
    assert [g.config.model for g in cosine] == [g.config.model for g in groups]
    assert groups[0].baseline and spec.seeds == [1, 2, 3]


def test_shipped_specs_resolve():
    names = spec_names()
    for name in ("cpu-paper", "cpu-nonlinear-q", "cpu-encoder-mlm", "cpu-wd-stability",
                 "paper-gpt2-small", "paper-gpt2-small-cosine"):
        assert name in names
    for name in names:
        spec = load_spec(name)
        groups = spec.groups()
        assert sum(g.baseline for g in groups) == 1
        if name.startswith("cpu-") and name != "cpu-smoke":
            assert len(spec.seeds) >= 3
    enc = load_spec("cpu-encoder-mlm").groups()
    assert all(g.config.train.objective == "mlm" and not g.config.model.causal for g in enc)
    assert [g.name for g in enc] == [g.name for g in load_spec("cpu-paper").groups()]
    nl = {g.name: g for g in load_spec("cpu-nonlinear-q").groups()}
    assert nl["nonlinear-q"].config.model.projection == "nonlinear-q"
    assert nl["wide-mlp"].config.model.mlp_ratio == 4.75
    # The baseline is cpu-paper's, exactly: its finished runs can be copied across.
    paper_base = load_spec("cpu-paper").groups()[0]
    assert config_identity(nl["baseline"].config) == config_identity(paper_base.config)
    # cpu-lr and cpu-width reuse cpu-paper's runs at lr 1e-3 and d = 256: same configs
    paper = {g.name: config_identity(g.config) for g in load_spec("cpu-paper").groups()}
    for name in ("cpu-lr", "cpu-width"):
        groups = {g.name: g for g in load_spec(name).groups()}
        for reused in ("baseline", "q-identity"):
            assert config_identity(groups[reused].config) == paper[reused], (name, reused)
    lr = load_spec("cpu-lr").groups()
    lrs = {f: sorted(g.config.optim.lr for g in lr if g.family == f)
           for f in ("baseline", "q-identity")}
    assert lrs == {"baseline": [5e-4, 1e-3, 2e-3], "q-identity": [5e-4, 1e-3, 2e-3, 4e-3]}
    assert all(g.config.optim.min_lr == pytest.approx(g.config.optim.lr / 10) for g in lr)
    wd = load_spec("cpu-wd-stability").groups()
    assert sorted(g.config.optim.weight_decay for g in wd if g.family == "q-identity") == \
        [0.0, 0.03125, 0.1, 0.3]


def test_paired_t_matches_scipy():
    a = [3.01, 3.02, 2.99, 3.05]
    b = [3.00, 3.035, 2.97, 3.02]
    t = paired_t([x - y for x, y in zip(a, b, strict=True)])
    ref = sst.ttest_rel(a, b)
    assert t.t == pytest.approx(ref.statistic) and t.p == pytest.approx(ref.pvalue)
    lo, hi = sst.t.interval(0.95, 3, loc=np.mean(np.subtract(a, b)),
                            scale=sst.sem(np.subtract(a, b)))
    assert (t.ci_low, t.ci_high) == (pytest.approx(lo), pytest.approx(hi))
    one = paired_t([0.1])
    assert one.n == 1 and one.p is None and one.ci_low is None and one.mean == 0.1
    same = paired_t([0.2, 0.2, 0.2])
    assert same.p == 0.0 and same.ci_low == same.ci_high == pytest.approx(0.2)
    assert summarize([1.0, 3.0]).std == pytest.approx(math.sqrt(2))


# ---- sweep ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_sweep_resumes_after_a_kill_and_report_has_the_statistics(
        data_dir, tmp_path, monkeypatch, capsys):
    spec = write_spec(tmp_path / "specs", data_dir)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(["sweep", str(spec), "--out", str(straight)]) == 0

    # A kill in the third run (baseline, seed 2) at step 6, after its checkpoint at step 4.
    real_step, calls = trainer.train_step, {"n": 0}

    def dying_step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 8 + 8 + 6:
            raise KeyboardInterrupt
        return real_step(*a, **k)

    monkeypatch.setattr(trainer, "train_step", dying_step)
    assert main(["sweep", str(spec), "--out", str(killed)]) == 130
    monkeypatch.setattr(trainer, "train_step", real_step)
    first = {p: (p / "metrics.jsonl").read_text() for p in
             (killed / "baseline" / "seed-1", killed / "q-identity" / "seed-1")}
    states = {r.run_dir.name + r.group.name: sweep_mod.run_state(r).status
              for r in load_spec(killed).runs(killed)}
    assert states == {"seed-1baseline": "done", "seed-1q-identity": "done",
                      "seed-2baseline": "partial", "seed-2q-identity": "pending"}
    # a report of the half-done sweep counts the spec's runs, not just the folders begun
    assert main(["report", str(killed), "--out", str(tmp_path / "early")]) == 0
    assert "2 of 4 runs finished" in (tmp_path / "early" / "report.md").read_text()
    capsys.readouterr()
    assert main(["sweep", str(killed)]) == 0  # the folder alone is enough to continue
    out = capsys.readouterr().out
    assert "resuming at step 4" in out and out.count("] ") == 2  # two runs left, not four
    for path, text in first.items():  # finished runs were skipped, not retrained
        assert (path / "metrics.jsonl").read_text() == text
    for group in ("baseline", "q-identity"):
        for seed in (1, 2):
            a = final_losses(straight / group / f"seed-{seed}")
            b = final_losses(killed / group / f"seed-{seed}")
            assert a == b, (group, seed)  # exact: resume replays the same batches
    assert main(["sweep", str(killed)]) == 0  # all done: nothing to train
    assert "all 4 runs done" in capsys.readouterr().out

    # the report against a direct computation from metrics.jsonl
    report_dir = tmp_path / "report"
    assert main(["report", str(killed), "--out", str(report_dir), "--per-window"]) == 0
    rep = json.loads((report_dir / "report.json").read_text())
    md = (report_dir / "report.md").read_text()
    assert (report_dir / "val_curves.png").stat().st_size > 0
    assert (report_dir / "rel_diff.png").stat().st_size > 0
    # the report compares the long final eval, which every run has (summary.json)
    assert rep["loss_measure"] == "long"
    loss = {(g, s): json.loads((killed / g / f"seed-{s}" / "summary.json").read_text())
            ["final_val_loss_long"]["loss"] for g in ("baseline", "q-identity") for s in (1, 2)}
    groups = {g["group"]: g for g in rep["groups"]}
    for g in ("baseline", "q-identity"):
        vals = [loss[(g, 1)], loss[(g, 2)]]
        got = groups[g]["final_val_loss"]
        assert got["n"] == 2
        assert got["mean"] == pytest.approx(np.mean(vals), abs=1e-12)
        assert got["std"] == pytest.approx(np.std(vals, ddof=1), abs=1e-12)
        assert f"{np.mean(vals):.4f} +- {np.std(vals, ddof=1):.4f}" in md
    q = [loss[("q-identity", s)] for s in (1, 2)]
    b = [loss[("baseline", s)] for s in (1, 2)]
    ref = sst.ttest_rel(q, b)
    d = np.subtract(q, b)
    lo, hi = sst.t.interval(0.95, 1, loc=d.mean(), scale=sst.sem(d))
    paired = groups["q-identity"]["paired_vs_baseline"]
    assert paired["seeds"] == [1, 2]
    assert paired["mean"] == pytest.approx(d.mean(), abs=1e-12)
    assert paired["t"] == pytest.approx(ref.statistic)
    assert paired["p"] == pytest.approx(ref.pvalue)
    assert (paired["ci_low"], paired["ci_high"]) == (pytest.approx(lo), pytest.approx(hi))
    assert paired["relative_pct"] == pytest.approx(100 * d.mean() / np.mean(b))
    assert f"{d.mean():+.4f}" in md and f"[{lo:+.4f}, {hi:+.4f}]" in md
    assert "qkvlab report" in md and "qkvlab sweep" in md and "torch" in md
    # per window: the mean over windows is the last logged val loss (clm, fp32)
    for g in ("baseline", "q-identity"):
        w = json.loads((killed / g / "seed-1" / "window_losses.json").read_text())["losses"]
        logged = final_losses(killed / g / "seed-1")[8]
        assert len(w) == 8 and np.mean(w) == pytest.approx(logged, rel=1e-5)
    assert groups["q-identity"]["per_window_vs_baseline"]["n"] == 8

    # --versus: the same statistics against another variant (here: baseline - q-identity)
    assert main(["report", str(killed), "--out", str(tmp_path / "vs"), "--versus",
                 "q-identity"]) == 0
    vs = json.loads((tmp_path / "vs" / "report.json").read_text())
    vs_md = (tmp_path / "vs" / "report.md").read_text()
    assert vs["baseline"] == "q-identity" and "--versus q-identity" in vs["command"]
    back = {g["group"]: g for g in vs["groups"]}["baseline"]["paired_vs_baseline"]
    assert back["mean"] == pytest.approx(-d.mean(), abs=1e-12)
    assert (back["ci_low"], back["ci_high"]) == (pytest.approx(-hi), pytest.approx(-lo))
    assert "Reference (`--versus`): **q-identity**" in vs_md and "than the baseline" not in vs_md
    capsys.readouterr()
    assert main(["report", str(killed), "--versus", "wide"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--versus wide is not a variant of spec" in err and "baseline, q-identity" in err
    assert len(err.splitlines()) == 1

    # the archive (records, no checkpoints) reports the same and counts as a finished sweep
    archived = tmp_path / "archived"
    assert main(["archive", str(killed), str(archived)]) == 0
    assert not list(archived.rglob("ckpt-*")) and not list(archived.rglob("*.safetensors"))
    assert main(["report", str(archived), "--out", str(tmp_path / "report2"),
                 "--per-window"]) == 0
    rep2 = json.loads((tmp_path / "report2" / "report.json").read_text())
    assert rep2["groups"] == rep["groups"]
    capsys.readouterr()
    assert main(["sweep", str(archived)]) == 0
    assert "all 4 runs done" in capsys.readouterr().out
    assert main(["archive", str(tmp_path), str(tmp_path / "x")]) == 2  # not a sweep folder


def test_archiving_two_sweeps_of_one_spec_merges_their_records(data_dir, tmp_path):
    """Runs of one grid trained in two places (a CPU, a GPU machine) end in one archive that
    keeps both launches and counts every run as done."""
    spec = write_spec(tmp_path / "s", data_dir)
    one, two, arch = tmp_path / "one", tmp_path / "two", tmp_path / "arch"
    for out, only in ((one, "baseline"), (two, "q-identity")):
        assert main(["sweep", str(spec), "--out", str(out), "--only", only, "--seeds", "1"]) == 0
    assert main(["archive", str(one), str(arch)]) == 0
    assert main(["archive", str(two), str(arch)]) == 0
    record = json.loads((arch / "sweep.json").read_text())
    launched = [s["command"] for s in record["sessions"]]
    assert len(launched) == 2 and "--only baseline" in launched[0]
    assert "--only q-identity" in launched[1]
    assert set(record["groups"]) == {"baseline", "q-identity"}
    assert main(["archive", str(two), str(arch)]) == 0  # again: nothing doubled
    assert json.loads((arch / "sweep.json").read_text())["sessions"] == record["sessions"]
    # a group the archive never ran, since dropped from the spec, leaves with the next archive
    stale = json.loads((arch / "sweep.json").read_text())
    stale["groups"]["dropped"] = stale["groups"]["q-identity"]
    (arch / "sweep.json").write_text(json.dumps(stale), encoding="utf-8")
    assert main(["archive", str(one), str(arch)]) == 0
    assert set(json.loads((arch / "sweep.json").read_text())["groups"]) == {
        "baseline", "q-identity"}
    # a sweep launched before the archive's last one keeps the archive's spec copy
    (one / "spec.toml").write_text("# an older spec\n", encoding="utf-8")
    early = json.loads((one / "sweep.json").read_text())
    early["sessions"][-1]["started"] = "2000-01-01T00:00:00+00:00"
    (one / "sweep.json").write_text(json.dumps(early), encoding="utf-8")
    assert main(["archive", str(one), str(arch)]) == 0
    assert (arch / "spec.toml").read_text() == (two / "spec.toml").read_text()
    assert json.loads((arch / "sweep.json").read_text())["fingerprint"] == record["fingerprint"]
    assert main(["report", str(arch), "--out", str(tmp_path / "rep")]) == 0
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["runs"]
    assert {(r["group"], r["status"]) for r in rows if r["seed"] == 1} == {
        ("baseline", "done"), ("q-identity", "done")}


@pytest.mark.slow
def test_reuse_copies_finished_runs_of_the_same_config(data_dir, tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["sweep", str(write_spec(tmp_path / "a", data_dir)), "--out", str(first)]) == 0
    other = write_spec(tmp_path / "b", data_dir, name="other",
                       extra='[[variant]]\nname = "nlq"\nrule = "nonlinear-q"\n')
    second = tmp_path / "second"
    capsys.readouterr()
    assert main(["sweep", str(other), "--out", str(second), "--dry-run", "--reuse",
                 str(first)]) == 0
    assert "4 of them would be copied from --reuse" in capsys.readouterr().out
    assert not second.exists()  # a dry run copies nothing
    assert main(["sweep", str(other), "--out", str(second), "--reuse", str(first)]) == 0
    out = capsys.readouterr().out
    assert out.count("copied the finished run") == 4 and out.count("] ") == 2  # nlq trained
    for group in ("baseline", "q-identity"):
        for seed in (1, 2):
            a, b = first / group / f"seed-{seed}", second / group / f"seed-{seed}"
            assert (b / "metrics.jsonl").read_text() == (a / "metrics.jsonl").read_text()
            assert load_config(b).out_dir == str(b)  # this sweep's folder
            # where it came from as <sweep>/<group>/seed-<n>, not a path of this machine
            assert json.loads((b / "reused.json").read_text())["from"] == \
                f"{first.name}/{group}/seed-{seed}"
    assert not list(second.rglob("*.copying"))
    assert main(["sweep", str(second)]) == 0
    assert "all 6 runs done" in capsys.readouterr().out
    assert main(["report", str(second), "--out", str(tmp_path / "r"), "--per-window"]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert sum(r["reused_from"] is not None for r in rep["runs"]) == 4
    assert f"4 run(s) copied from the sweep `{first.name}`" in \
        (tmp_path / "r" / "report.md").read_text()
    # a sweep that reused an archive's runs, archived back into it: the copies are not copied
    # back (the archive's runs would gain a reused.json naming themselves), the new runs are
    arch, more = tmp_path / "docs" / "tiny", tmp_path / "more"
    assert main(["archive", str(first), str(arch)]) == 0
    assert main(["sweep", str(tmp_path / "a" / "tiny.toml"), "--out", str(more), "--seeds",
                 "1,3", "--reuse", str(arch)]) == 0
    assert (more / "baseline" / "seed-1" / "reused.json").is_file()
    capsys.readouterr()
    assert main(["archive", str(more), str(arch)]) == 0
    assert "copied the records of 2 runs" in capsys.readouterr().out
    assert not list(arch.rglob("reused.json"))
    assert (arch / "baseline" / "seed-3" / "summary.json").is_file()
    # another config (a different lr) is not the same run: nothing is copied
    capsys.readouterr()
    assert main(["sweep", str(other), "--out", str(tmp_path / "third"), "--dry-run",
                 "--set", "optim.lr=1e-3", "--reuse", str(first)]) == 0
    assert "copied from --reuse" not in capsys.readouterr().out
    assert main(["sweep", str(other), "--out", str(tmp_path / "x"), "--reuse",
                 str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a sweep folder" in err and len(err.splitlines()) == 1


def test_sweep_refusals_happen_before_training(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "specs", data_dir)
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--only", "baseline",
                 "--seeds", "1"]) == 0
    # another spec's folder
    other = write_spec(tmp_path / "other", data_dir, name="other")
    assert main(["sweep", str(other), "--out", str(out)]) == 2
    assert "holds the sweep of spec 'tiny'" in capsys.readouterr().err
    # the same spec name, a variant changed
    changed = write_spec(tmp_path / "changed", data_dir, extra="weight_decay = 0.5")
    assert main(["sweep", str(changed), "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "variant q-identity differs at optim.weight_decay (0.03125 -> 0.5)" in err
    # a folder that is not a sweep
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "busy")]) == 2
    assert "is not a sweep folder" in capsys.readouterr().err
    # a run folder trained with another config
    fresh = tmp_path / "fresh"
    run_dir = fresh / "baseline" / "seed-2"
    run_dir.mkdir(parents=True)
    save_config(load_config(str(tmp_path / "specs" / "base.toml"), ["optim.lr=1e-2"]),
                run_dir / "config.toml")
    (fresh / "sweep.json").write_text(json.dumps({"spec": "tiny", "groups": {}}))
    assert main(["sweep", str(spec), "--out", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert "was trained with another config" in err and "optim.lr (0.01 -> 0.003)" in err
    assert not (fresh / "baseline" / "seed-1").exists()  # refused before any run started
    # unknown --only, bad --seeds
    assert main(["sweep", str(spec), "--out", str(out), "--only", "nope"]) == 2
    assert "not a variant of spec tiny" in capsys.readouterr().err
    assert main(["sweep", str(spec), "--out", str(out), "--seeds", "1,x"]) == 2
    capsys.readouterr()


def test_a_sweep_folder_records_its_set_overrides(data_dir, tmp_path, capsys):
    """The report command a sweep suggests, and a resume of its folder, need no --set again."""
    spec = write_spec(tmp_path / "s", data_dir)
    out = tmp_path / "sw"
    sets = ["--set", "train.max_steps=4", "--set", "optim.lr=1e-3"]
    assert main(["sweep", str(spec), "--out", str(out), *sets]) == 0
    assert f"report: qkvlab report {out}" in capsys.readouterr().out
    record = json.loads((out / "sweep.json").read_text())
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["runs"]
    assert {(r["group"], r["status"], r["steps"]) for r in rows} == {
        ("baseline", "done", 4), ("q-identity", "done", 4)}
    capsys.readouterr()
    assert main(["sweep", str(out), "--dry-run"]) == 0
    assert f"4 runs in {out}: 4 done" in capsys.readouterr().out
    copy = (out / "spec.toml").read_text()
    assert main(["sweep", str(out)]) == 0
    assert "all 4 runs done" in capsys.readouterr().out
    assert main(["sweep", str(out), *sets]) == 0  # the same overrides again: recorded once
    assert tomllib.loads((out / "spec.toml").read_text()) == tomllib.loads(copy)
    assert json.loads((out / "sweep.json").read_text())["groups"] == record["groups"]
    # the spec itself without them is another config: the refusal names the folder's way on
    assert main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 2
    assert f"(qkvlab sweep {out})" in capsys.readouterr().err
    # folded into the spec, the overrides resolve exactly as they do given on their own
    plain = load_spec(spec)
    overrides = ["train.max_steps=4", "optim.lr=1e-3"]
    assert [g.fingerprint for g in plain.with_overrides(overrides).groups()] == \
        [g.fingerprint for g in plain.groups(overrides)]


def test_a_finished_run_of_another_length_is_no_answer_to_a_sweep(data_dir, tmp_path, capsys):
    """The sweep's rule is compare's: a finished run counts only with the config asked for,
    its length and evaluations included (a longer one is resumed, as before)."""
    spec = write_spec(tmp_path / "s", data_dir)
    out = tmp_path / "sw"
    one = ["--only", "baseline", "--seeds", "1"]
    assert main(["sweep", str(spec), "--out", str(out), *one, "--set", "train.max_steps=4"]) == 0
    run = out / "baseline" / "seed-1"
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for changed, named in [(["--set", "train.max_steps=2"], "train.max_steps (saved 4, now 2)"),
                           (["--set", "train.max_steps=4", "--set", "train.eval_windows=4"],
                            "train.eval_windows (saved 8, now 4)")]:
        for args in (["sweep", str(spec), "--out", str(out), *one, *changed],
                     ["sweep", str(out), *changed, "--dry-run"]):
            err = refused(capsys, args)
            assert f"run folder {run} finished with another config than this sweep asks" in err
            assert named in err and "choose another --out" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
    # --reuse copies no run of another length either
    assert main(["sweep", str(spec), "--out", str(tmp_path / "other"), *one, "--reuse", str(out),
                 "--set", "train.max_steps=2", "--dry-run"]) == 0
    assert "copied from --reuse" not in capsys.readouterr().out
    assert main(["sweep", str(spec), "--out", str(tmp_path / "same"), *one, "--reuse", str(out),
                 "--set", "train.max_steps=4", "--dry-run"]) == 0
    assert "1 of them would be copied from --reuse" in capsys.readouterr().out
    # a longer sweep resumes the finished run from its last checkpoint
    assert main(["sweep", str(out), "--set", "train.max_steps=6"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_run_another_process_trains_is_skipped_not_failed(data_dir, tmp_path, capsys, jobs):
    """Two sweeps sharing a folder: a run whose lock a live process holds is left to it."""
    spec = write_spec(tmp_path / "specs", data_dir)
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--only", "baseline", "--seeds", "1"]) == 0
    busy = out / "q-identity" / "seed-1"
    busy.mkdir(parents=True)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        started = run_lock._start_time(holder.pid)
        (busy / ".lock").write_text(f"{holder.pid} {socket.gethostname()} {started}\n")
        assert main(["sweep", str(spec), "--out", str(out), "--seeds", "1", "--dry-run"]) == 0
        assert "1 running" in capsys.readouterr().out
        assert main(["sweep", str(spec), "--out", str(out), "--seeds", "1",
                     "--jobs", jobs]) == 0
        printed = capsys.readouterr().out
        assert f"trained by process {holder.pid}" in printed and "skipped" in printed
        assert not (busy / "failed.json").exists() and not (busy / "metrics.jsonl").exists()
        # the check a sweep makes again just before it starts each run
        run = next(r for r in load_spec(str(spec)).runs(out) if r.run_dir == busy)
        assert sweep_mod.claimed_elsewhere(run) == (
            f"trained by process {holder.pid} on {socket.gethostname()} now")
    finally:
        holder.kill()
        holder.wait()
    # its process gone, the next sweep trains it
    assert main(["sweep", str(spec), "--out", str(out), "--seeds", "1"]) == 0
    assert "all 2 runs done" in capsys.readouterr().out
    assert (busy / "summary.json").is_file()
    assert sweep_mod.claimed_elsewhere(run) == "finished meanwhile"


def test_missing_data_and_huge_grids_are_refused(data_dir, tmp_path, capsys):
    folder = tmp_path / "specs"
    spec = write_spec(folder, data_dir, extra='set = ["data.dir=/nonexistent/owt"]')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "a")]) == 2
    assert "no prepared data at /nonexistent/owt" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    lrs = ", ".join(f"{5e-4 + 1e-5 * i:.6g}" for i in range(60))
    big = write_spec(tmp_path / "big", data_dir, extra=f"grid = {{ lr = [{lrs}] }}")
    assert main(["sweep", str(big), "--out", str(tmp_path / "b")]) == 2
    assert "would launch 122 runs" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    assert main(["sweep", str(big), "--out", str(tmp_path / "b"), "--dry-run"]) == 0
    assert "needs --yes" in capsys.readouterr().out


@pytest.mark.slow
def test_dry_run_print_commands_and_launcher(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "specs", data_dir)
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "4 runs" in text and "q-identity" in text and "2 pending" in text
    assert not out.exists()  # a dry run writes nothing
    assert main(["sweep", str(spec), "--out", str(out), "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(" && qkvlab train " in c and c.endswith("--resume")
                                   for c in lines)
    run_dir = out / "q-identity" / "seed-2"
    assert f"train {run_dir.resolve()} --resume" in lines[-1]
    # what a scheduler would run: the printed command's train part
    assert main(["train", str(run_dir), "--resume"]) == 0
    capsys.readouterr()
    assert main(["sweep", str(out), "--dry-run"]) == 0
    assert "1 done" in capsys.readouterr().out
    # the launcher path: the run goes through a subprocess (`python -m qkvlab train`)
    import shlex
    import sys

    assert main(["sweep", str(out), "--only", "baseline", "--seeds", "1",
                 "--launcher", shlex.quote(sys.executable)]) == 0
    assert (out / "baseline" / "seed-1" / "summary.json").is_file()
    record = json.loads((out / "sweep.json").read_text())
    assert record["spec"] == "tiny" and len(record["fingerprint"]) == 64
    assert any("--launcher" in s["command"] for s in record["sessions"])


def test_records_from_before_a_new_config_key_still_match():
    from qkvlab.experiments.spec import identity_diff

    g = load_spec("cpu-smoke").groups()[0]
    old = json.loads(json.dumps(g.identity))
    del old["train"]["objective"], old["train"]["mlm_prob"]  # keys added to qkvlab later
    old["train"]["retired_key"] = 1  # a key qkvlab no longer has
    assert identity_diff(old, g.identity) == []
    old["optim"]["lr"] = 5.0
    assert identity_diff(old, g.identity) == ["optim.lr (5.0 -> 0.001)"]


def test_encoder_sweep_reports_masked_accuracy(data_dir, tmp_path, capsys):
    folder = tmp_path / "specs"
    tiny_base(data_dir, folder)
    spec = folder / "enc.toml"
    spec.write_text("""
[spec]
name = "enc"
base = "base.toml"
set = ["train.objective=mlm", "model.causal=false", "train.max_steps=4"]
seeds = [1]

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"

[[variant]]
name = "q-identity"
rule = "q-identity"
""", encoding="utf-8")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert main(["report", str(out)]) == 0
    md = (out / "report" / "report.md").read_text()
    last = [r for r in read_metrics(out / "q-identity" / "seed-1") if "val_acc" in r][-1]
    assert "final val acc" in md and f"{last['val_acc']:.4f}" in md
    assert "claimed for encoders, never trained" in md and "one seed only" in md
    # a causal model with mlm is refused before training
    bad = folder / "bad.toml"
    bad.write_text(spec.read_text().replace('"model.causal=false", ', ""), encoding="utf-8")
    assert main(["sweep", str(bad), "--out", str(tmp_path / "bad")]) == 2
    assert "mlm needs a bidirectional encoder" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_jobs_trains_runs_in_parallel_with_the_same_results(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "a", data_dir)
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert main(["sweep", str(spec), "--out", str(serial), "--only", "baseline"]) == 0
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", str(parallel), "--only", "baseline",
                 "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("started baseline") == 2 and out.count("finished baseline") == 2
    for seed in (1, 2):
        run = parallel / "baseline" / f"seed-{seed}"
        assert "done at step 8" in (run / "train.log").read_text()
        # fp32 on one thread against the test's one thread: the same trajectory
        assert final_losses(run) == pytest.approx(final_losses(serial / "baseline" /
                                                                f"seed-{seed}"), rel=1e-5)
    record = json.loads((parallel / "sweep.json").read_text())
    assert "--jobs 2" in record["sessions"][-1]["command"]
    assert main(["sweep", str(spec), "--out", str(parallel), "--jobs", "0"]) == 2
    assert main(["sweep", str(spec), "--out", str(parallel), "--jobs", "2", "--launcher",
                 "python"]) == 2


def test_archive_finished_leaves_out_runs_still_training(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "specs", data_dir)
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--only", "baseline"]) == 0
    # a run stopped by a signal, as a sweep still training leaves one behind
    stopped = out / "baseline" / "seed-2" / "summary.json"
    stopped.write_text(stopped.read_text().replace('"interrupted": false',
                                                   '"interrupted": true'), encoding="utf-8")
    capsys.readouterr()
    dest = tmp_path / "archived"
    assert main(["archive", str(out), str(dest), "--finished"]) == 0
    said = capsys.readouterr().out
    assert "records of 1 runs" in said and "left out 1 unfinished run(s)" in said
    assert (dest / "baseline" / "seed-1" / "metrics.jsonl").is_file()
    assert not (dest / "baseline" / "seed-2").exists()
    assert main(["archive", str(out), str(dest)]) == 0  # without --finished: every run
    assert (dest / "baseline" / "seed-2" / "metrics.jsonl").is_file()
