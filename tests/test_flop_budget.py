"""train.flop_budget: the steps a budget pays for, the schedule fitted to them, one length per
config, sweeps over budgets, exact resume, and fingerprints that stay what they were."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest

from helpers import refused, tiny_config
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import config_identity, load_spec
from qkvlab.model.params import count_params, flops_per_token
from qkvlab.run.config import RunConfig, load_config, save_config
from qkvlab.run.metrics import read_metrics
from qkvlab.train import trainer
from qkvlab.train.optim import lr_at, run_lr
from qkvlab.train.trainer import train

REPO = Path(__file__).resolve().parents[1]
# 2 layers x d 32 (2 heads of 16), context 16, vocabulary 64, tied head, no biases, batch 4
SHAPE = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
         "model.vocab_size=64", "train.batch_size=4", "train.grad_accum=1"]
# by hand: per layer W_Q, W_K, W_V, W_O 4 x 32 x 32 = 4,096 and the MLP 2 x 32 x 128 = 8,192;
# two layers and the head (64 x 32) are 26,624 matmul weights; attention 2 L H d_k T =
# 2 x 2 x 2 x 16 x 16 = 2,048 per token; training = 3 x (2 x 26,624 + 2 x 2,048) = 172,032
# FLOPs a token, x 64 tokens a step = 11,010,048 FLOPs a step
PER_STEP = 11_010_048
# W_Q = I drops 2 x 1,024 weights: 3 x (2 x 24,576 + 4,096) = 159,744 a token, 10,223,616 a step
PER_STEP_QID = 10_223_616


def budget_config(*extra: str) -> RunConfig:
    return load_config("shakespeare-char", [*SHAPE, "optim.warmup_fraction=0.25", *extra])


def test_the_steps_are_the_whole_steps_the_budget_pays_for():
    cfg = budget_config("train.flop_budget=1.1e8")
    assert flops_per_token(cfg.model) * cfg.tokens_per_step == cfg.flops_per_step == PER_STEP
    assert cfg.train.max_steps is None and cfg.steps == 9  # 1.1e8 / 11,010,048 = 9.99
    assert cfg.train_flops == 9 * PER_STEP <= 1.1e8
    # exactly ten steps' FLOPs buy ten steps, one FLOP fewer nine
    assert budget_config(f"train.flop_budget={10 * PER_STEP}").steps == 10
    assert budget_config(f"train.flop_budget={10 * PER_STEP - 1}").steps == 9
    # the identity query costs fewer FLOPs, so the same budget buys it more steps
    qid = budget_config("train.flop_budget=1.1e8", "model.projection=q-identity")
    assert qid.flops_per_step == PER_STEP_QID and qid.steps == 10


def test_the_schedule_is_fitted_to_the_budget():
    cfg = budget_config("train.flop_budget=1.1e8", "optim.lr=1e-3", "optim.min_lr=1e-4")
    assert cfg.decay_steps == cfg.steps == 9 and cfg.warmup_steps == 2  # round(0.25 x 9)
    lrs = [run_lr(step, cfg) for step in range(10)]
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])  # linear warmup over 2 steps
    assert lrs[2] == pytest.approx(1e-3)  # the cosine starts at the peak...
    assert lrs[9] == pytest.approx(1e-4)  # ...and reaches min_lr at the budget's last step
    assert all(a > b for a, b in zip(lrs[2:9], lrs[3:10], strict=False))
    assert lrs == [lr_at(step, cfg.optim, 9, 2) for step in range(10)]
    # a larger budget moves the horizon with the steps
    bigger = budget_config("train.flop_budget=2.2e8", "optim.lr=1e-3", "optim.min_lr=1e-4")
    assert (bigger.steps, bigger.decay_steps, bigger.warmup_steps) == (19, 19, 5)
    assert run_lr(9, bigger) > 5e-4 > run_lr(9, cfg)


def test_one_length_per_config(tmp_path):
    # a budget set over a config with max_steps (and the preset's decay_steps) replaces them
    cfg = budget_config("train.flop_budget=1.1e8")
    assert cfg.optim.decay_steps is None and cfg.train.max_steps is None
    # max_steps set over a budget replaces it, and so does a fixed warmup a fraction
    back = load_config("shakespeare-char", [*SHAPE, "train.flop_budget=1.1e8",
                                            "train.max_steps=7", "optim.warmup_steps=3"])
    assert (back.train.flop_budget, back.steps, back.warmup_steps) == (None, 7, 3)
    # the saved config reads back the same, without max_steps
    path = save_config(cfg, tmp_path / "config.toml")
    assert "max_steps" not in path.read_text() and "flop_budget = 110000000.0" in \
        path.read_text()
    assert load_config(path) == cfg
    # both in one file: refused, naming both
    text = path.read_text().replace("[train]\n", "[train]\nmax_steps = 5\n")
    (tmp_path / "both.toml").write_text(text)
    with pytest.raises(QkvlabError, match="train.max_steps and train.flop_budget are both set"):
        load_config(tmp_path / "both.toml")
    text = path.read_text().replace("[optim]\n", "[optim]\ndecay_steps = 50\n")
    (tmp_path / "decay.toml").write_text(text)
    with pytest.raises(QkvlabError, match="optim.decay_steps and train.flop_budget are both"):
        load_config(tmp_path / "decay.toml")
    text = path.read_text().replace("[optim]\n", "[optim]\nwarmup_steps = 5\n")
    (tmp_path / "warmup.toml").write_text(text)
    with pytest.raises(QkvlabError, match="warmup_steps and optim.warmup_fraction are both"):
        load_config(tmp_path / "warmup.toml")


@pytest.mark.parametrize(("value", "needle"), [
    ("0", "train.flop_budget must be > 0 (training FLOPs) or unset, got 0.0"),
    ("-1e13", "train.flop_budget must be > 0"),
    ("inf", "train.flop_budget must be a finite number"),
    ("true", "train.flop_budget must be float"),
    ("1e7", "train.flop_budget = 1e+07 FLOPs does not pay for one step of this model "
            "(1.101e+07 FLOPs: 1.72e+05 per token x 64 tokens)"),
])
def test_bad_budgets_are_one_line_errors(capsys, tmp_path, value, needle):
    err = refused(capsys, ["train", "shakespeare-char", *[a for s in SHAPE for a in ("--set", s)],
                           "--set", f"train.flop_budget={value}", "--out", str(tmp_path / "r")])
    assert needle in err
    assert not (tmp_path / "r").exists()


def test_a_budget_that_ends_inside_the_warmup_is_refused():
    with pytest.raises(QkvlabError, match="buys 9 steps, no more than the warmup's 100: set "
                                          "optim.warmup_fraction"):
        load_config("shakespeare-char", [*SHAPE, "train.flop_budget=1.1e8"])
    with pytest.raises(QkvlabError, match="optim.warmup_fraction must be in"):
        budget_config("optim.warmup_fraction=1.0")


def test_new_keys_at_their_defaults_leave_fingerprints_alone():
    identity = config_identity(RunConfig())
    assert "flop_budget" not in identity["train"]
    assert "warmup_fraction" not in identity["optim"]
    assert identity["optim"]["warmup_steps"] == 100
    budget = config_identity(budget_config("train.flop_budget=1.1e8"))
    assert budget["train"]["flop_budget"] == 1.1e8 and budget["optim"]["warmup_fraction"] == 0.25
    # every archived group of a study made before the keys existed resolves to its fingerprint
    sweep = REPO / "docs/results/sweeps/english-scale"
    recorded = json.loads((sweep / "sweep.json").read_text())["groups"]
    groups = load_spec(sweep).groups()
    assert len(groups) > 100
    assert all(recorded[g.name]["fingerprint"] == g.fingerprint for g in groups)


def test_a_budget_grid_resolves_and_dry_runs(data_dir, tmp_path, capsys):
    folder = tmp_path / "specs"
    folder.mkdir()
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    save_config(tiny_config(data_dir, "optim.warmup_fraction=0.25", "optim.decay_steps=8",
                            vocab=vocab), folder / "base.toml")
    spec = folder / "budgets.toml"
    spec.write_text("""
[spec]
name = "budgets"
base = "base.toml"
seeds = [1]

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"

[[variant]]
name = "q-identity"
rule = "q-identity"
grid = { flop_budget = [3e7, 1.5e8] }
""")
    groups = {g.name: g for g in load_spec(spec).groups()}
    assert list(groups) == ["baseline", "q-identity.flops3e7", "q-identity.flops1.5e8"]
    assert groups["baseline"].config.steps == 8  # the base's max_steps
    small, large = groups["q-identity.flops3e7"].config, groups["q-identity.flops1.5e8"].config
    per_step = small.flops_per_step
    assert (small.steps, large.steps) == (int(3e7 // per_step), int(1.5e8 // per_step))
    assert small.train.max_steps is None and small.optim.decay_steps is None
    assert small.decay_steps == small.steps and large.decay_steps == large.steps
    assert groups["q-identity.flops3e7"].fingerprint != groups["q-identity.flops1.5e8"].fingerprint
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in text.splitlines() if "q-identity.flops" in line}
    for name, cfg in (("q-identity.flops3e7", small), ("q-identity.flops1.5e8", large)):
        assert f"{cfg.steps:,}" in rows[name]
        assert f"{cfg.steps * cfg.tokens_per_step:,}" in rows[name]
    left = 8 * groups["baseline"].config.flops_per_step + small.train_flops + large.train_flops
    assert f"{left / 1e15:.3g} PFLOP left" in text
    # --set of a budget over the whole spec replaces the base's length in every group
    over = load_spec(spec).with_overrides(["train.flop_budget=6e7"])
    base = next(g for g in over.groups() if g.name == "baseline").config
    assert base.train.flop_budget == 6e7 and base.steps == int(6e7 // base.flops_per_step)
    bad = spec.read_text().replace("[3e7, 1.5e8]", "[1e3]")
    (folder / "bad.toml").write_text(bad)
    err = refused(capsys, ["sweep", str(folder / "bad.toml"), "--out", str(tmp_path / "o2"),
                           "--dry-run"])
    assert "variant q-identity at {'flop_budget': 1000.0}" in err and "one step" in err


def test_a_budget_run_trains_its_steps_and_resumes_exactly(data_dir, tmp_path, monkeypatch):
    per_step = tiny_config(data_dir).flops_per_step

    def config(out: Path) -> RunConfig:  # the tiny run, its length a budget of 8.5 steps
        return tiny_config(data_dir, "model.dropout=0.1", "optim.warmup_fraction=0.25",
                           f"train.flop_budget={8.5 * per_step!r}", f"run.out_dir={out}")

    cfg = config(tmp_path / "a")
    assert cfg.steps == 8 and cfg.warmup_steps == 2 and cfg.decay_steps == 8
    straight = train(cfg, quiet=True)
    assert straight["steps"] == 8 and straight["train_flops"] == cfg.train_flops
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "a") if "lr" in r}
    # the record of step k holds the lr its last update (index k - 1) trained with
    assert [logged[k] for k in range(1, 9)] == [run_lr(k, cfg) for k in range(8)]
    assert run_lr(8, cfg) == pytest.approx(cfg.optim.min_lr)  # the horizon is the budget's end
    real_step = trainer.train_step

    def step_then_sigterm(s, step):
        rec = real_step(s, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return rec

    monkeypatch.setattr(trainer, "train_step", step_then_sigterm)
    assert train(config(tmp_path / "b"), quiet=True)["steps"] == 3
    monkeypatch.setattr(trainer, "train_step", real_step)
    resumed = train(config(tmp_path / "b"), resume=True, quiet=True)
    assert resumed["resumed_from"] == 3 and resumed["steps"] == 8
    def losses(run: Path) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("lr"), r.get("val_loss"))
                for r in read_metrics(run)]

    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # bitwise
    assert straight["final_val_loss"] == resumed["final_val_loss"]
    # another budget is another schedule: refused on resume, the folder untouched
    other = dataclasses.replace(cfg, out_dir=str(tmp_path / "b"), train=dataclasses.replace(
        cfg.train, flop_budget=20.5 * cfg.flops_per_step))
    with pytest.raises(QkvlabError, match="train.flop_budget"):
        train(other, resume=True, quiet=True)


def test_the_isoflop_spec_trains_each_size_for_exactly_its_budget():
    groups = load_spec("mup-isoflop").groups()
    assert sum(g.baseline for g in groups) == 1
    for g in groups:
        cfg, m = g.config, g.config.model
        budget = cfg.train.flop_budget
        assert budget - cfg.flops_per_step < cfg.train_flops <= budget
        assert cfg.decay_steps == cfg.steps and cfg.warmup_steps == round(0.1 * cfg.steps)
        assert m.d_head == 64 and m.n_head == m.n_embd // 64 and m.parametrization == "mup"
        assert cfg.optim.weight_decay == 0.1
        # W_Q = I carries its base alpha; the baseline's follows its measured 128 / d
        arm = "baseline" if g.family.startswith("baseline") else "q-identity"
        assert m.projection == arm
        assert m.alpha == pytest.approx(1.0 if arm != "baseline" else round(128 / m.n_embd, 3))
        # W_Q = I meets the baseline at its own lr at that budget, or each at its best (`*-tuned`)
        if arm == "baseline" or g.config.optim.lr == 1.6e-2:
            assert g.versus == ""
        elif g.family.endswith("-tuned"):
            assert g.versus == "baseline-tuned"
        else:
            assert {h.config.optim.lr for h in groups if h.family == g.versus and (
                g.versus != "baseline-tuned"
                or h.config.train.flop_budget == cfg.train.flop_budget)} == {cfg.optim.lr}
    # the lr checks at each budget's minimum, each arm's lrs stepped down by factors of 2 until
    # its best is bracketed; `*-tuned`: each arm at the lr that was best at that budget's
    # minimum, with the sizes beside it; at 1.6e14 after an lr scan at d 64 x 8
    checks = [g for g in groups if "-lr" in g.name]
    got = {(g.family, g.config.optim.lr, g.config.model.n_embd, g.config.model.n_layer,
            g.config.train.flop_budget) for g in checks}
    arms = ("baseline", "q-identity")
    tuned = ({(f"{arm}-tuned", 4e-3, 64, n, 1e13) for arm in arms for n in (1, 2, 4)}
             | {("baseline-tuned", 4e-3, d, n, 4e13) for d, n in ((64, 2), (64, 4), (128, 4))}
             | {("q-identity-tuned", 2e-3, d, n, 4e13) for d, n in ((64, 2), (64, 4), (128, 4))}
             | {("q-identity-wide-tuned", 4e-3, d, n, 4e13)
                for d, n in ((64, 2), (64, 4), (128, 4))}
             | {(f"{arm}-tuned", lr, d, n, 1.6e14)
                for arm, lr in zip(arms, (4e-3, 8e-3), strict=True)
                for d, n in ((64, 4), (64, 8), (128, 4), (192, 4))})
    scans = ({(f"{arm}-lr{lr}", float(lr), 64, 2, 1e13) for arm in arms for lr in ("8e-3", "2e-3")}
             | {("baseline-lr8e-3", 8e-3, 64, 4, 4e13), ("baseline-lr2e-3", 2e-3, 64, 4, 4e13)}
             | {(f"q-identity-lr{lr}", float(lr), 64, 4, 4e13) for lr in ("8e-3", "4e-3", "1e-3")}
             | {(f"{arm}-lr{lr}", float(lr), 64, 8, 1.6e14)
                for arm in arms for lr in ("2e-3", "1e-3")}
             | {(f"{arm}-lr{lr}", float(lr), d, n, 1.6e14)  # each towards the other's lr
                for arm, lr in (("baseline", "8e-3"), ("q-identity", "4e-3"))
                for d, n in ((64, 8), (128, 4))}
             | {(f"q-identity-wide-lr{lr}", float(lr), 64, 4, 4e13) for lr in ("8e-3", "2e-3")})
    assert got == tuned | scans and len(checks) == len(got)
    for g in checks:  # the wider MLP at every lr: 4d + d/2, the d^2 per layer W_Q = I saves
        m = g.config.model
        assert (m.hidden == 4 * m.n_embd + m.n_embd // 2) == g.family.startswith("q-identity-wide")
    # the curves at the carried lr (1.6e-2)
    groups = [g for g in groups if g not in checks]
    cells = {(g.family, g.config.model.n_embd, g.config.model.n_layer,
              g.config.train.flop_budget) for g in groups}
    widths = (64, 128, 192, 256, 320)
    assert cells == ({(arm, d, 4, b) for arm in arms for d in widths for b in (1e13, 4e13)}
                     | {(arm, 64, 2, b) for arm in arms for b in (1e13, 4e13)}
                     | {(arm, 64, 1, 1e13) for arm in arms}
                     | {("q-identity-wide", d, 4, 4e13) for d in widths}
                     | {("q-identity-wide", 64, 2, 4e13)}
                     | {("q-identity", 64, 8, 1.6e14)})  # the top of 1.6e14's lr scan
    params = {(g.family, g.config.model.n_embd, g.config.model.n_layer):
              count_params(g.config.model).non_embedding for g in groups}
    for g in groups:
        cfg, m = g.config, g.config.model
        depth = "" if m.n_layer == 4 else f"-l{m.n_layer}"
        assert g.name == f"{g.family}-d{m.n_embd}{depth}.flops{cfg.train.flop_budget:g}".replace(
            "e+", "e")
        assert cfg.optim.lr == 1.6e-2
        if g.family == "q-identity-wide":
            # the MLP gets the d^2 per layer W_Q = I saves at this width, not at the base's
            assert m.hidden == 4 * m.n_embd + m.n_embd // 2
            assert params[g.family, m.n_embd, m.n_layer] == params["baseline", m.n_embd, m.n_layer]
