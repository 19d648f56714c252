"""Numbers a config can hold but no run can use: integers too large for a double in float
fields, seeds torch cannot take, attention scales that only make NaN, and the retrofit's
closed share of a gap too small to split. Each is refused in one line (exit 2) before anything
is written, or printed without the meaningless share."""

import hashlib
import json
from pathlib import Path

import pytest

from helpers import refused, tiny_overrides
from qkvlab.cli import main
from qkvlab.commands.retrofit import _print_report
from qkvlab.retrofit.checkpoint import RetrofitReport
from qkvlab.retrofit.heal import HealConfig, HealResult
from qkvlab.retrofit.init import InitInfo

BIG = 10**400  # a valid TOML and JSON integer that no double holds
BIG_TEXT = str(BIG)


def sets(items) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


# ---- integers too large for a float field -----------------------------------------------------
@pytest.mark.parametrize("key", ["optim.lr", "model.mlp_ratio", "model.attn_scale",
                                 "model.init_std", "train.peak_flops"])
def test_params_refuses_a_huge_integer_in_a_float_field(capsys, key):
    err = refused(capsys, ["params", "shakespeare-char", "--set", f"{key}={BIG_TEXT}"])
    assert key.split(".")[1] in err and "401 digits" in err and BIG_TEXT not in err


def test_train_refuses_a_huge_learning_rate_and_writes_nothing(capsys, data_dir, tmp_path):
    run = tmp_path / "run"
    args = ["train", "shakespeare-char", "--out", str(run),
            *sets(tiny_overrides(data_dir, f"optim.lr={BIG_TEXT}"))]
    assert "optim.lr must be a finite number" in refused(capsys, args)
    assert not run.exists()


def test_a_toml_file_with_a_huge_integer_is_refused(capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f"[optim]\nlr = {BIG_TEXT}\n")
    assert "optim.lr must be a finite number" in refused(capsys, ["params", str(config)])
    config.write_text("[optim]\nlr = 1" + "0" * 5000 + "\n")  # past Python's int-reading limit
    assert "too long to read" in refused(capsys, ["params", str(config)])


def test_an_override_past_the_int_reading_limit_is_refused(capsys):
    err = refused(capsys, ["params", "shakespeare-char", "--set", "optim.lr=1" + "0" * 5000])
    assert "too long" in err and len(err) < 300


def write_spec(path: Path, head: str = "", variant: str = "") -> Path:
    path.write_text(f'[spec]\nname = "x"\nbase = "shakespeare-char"\n{head}\n'
                    f'[[variant]]\nname = "b"\nbaseline = true\n{variant}\n')
    return path


def test_a_spec_grid_with_a_huge_integer_is_refused_in_the_dry_run(capsys, tmp_path):
    spec = write_spec(tmp_path / "s.toml", variant=f'[[variant]]\nname = "wide"\n'
                                                    f"grid = {{ lr = [{BIG_TEXT}] }}")
    out = tmp_path / "sweep"
    err = refused(capsys, ["sweep", str(spec), "--dry-run", "--out", str(out)])
    assert "optim.lr must be a finite number" in err
    assert not out.exists()


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    """A finished tiny run with checkpoints at steps 4 and 8."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "shakespeare-char", "--out", str(run),
                 *sets(tiny_overrides(data_dir))]) == 0
    return run


def test_a_huge_attn_scale_in_a_checkpoint_state_is_refused(capsys, trained):
    ckpt = trained / "ckpt-0000004"
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["attn_scale"] = BIG
    (ckpt / "state.json").write_text(json.dumps(state))
    # a consistent manifest: the state is well-formed and verified, only its number is wrong
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "state.json").read_bytes()
    manifest["files"]["state.json"] = {"size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    err = refused(capsys, ["sample", str(ckpt), "--max-new-tokens", "2"])
    assert "attn_scale must be a number in" in err


# ---- seeds ------------------------------------------------------------------------------------
def test_sweep_refuses_a_seed_torch_cannot_take(capsys, tmp_path):
    out = tmp_path / "sweep"
    for extra in (["--dry-run"], []):
        err = refused(capsys, ["sweep", "cpu-smoke", "--seeds", "99999999999999999999999",
                               "--out", str(out), *extra])
        assert "--seeds" in err and "2**63 - 1" in err
        assert not out.exists()


def test_a_spec_seed_torch_cannot_take_is_refused_in_the_dry_run(capsys, tmp_path):
    spec = write_spec(tmp_path / "s.toml", head=f"seeds = [{2**70}]")
    out = tmp_path / "sweep"
    for extra in (["--dry-run"], []):
        err = refused(capsys, ["sweep", str(spec), "--out", str(out), *extra])
        assert "seeds must be" in err and "2**63 - 1" in err
        assert not out.exists()


def test_retrofit_and_verify_refuse_a_seed_torch_cannot_take(capsys, trained, tmp_path):
    out = tmp_path / "retrofit"
    err = refused(capsys, ["retrofit", str(trained), "--steps", "0", "--out", str(out),
                           "--seed", str(2**70)])
    assert "--seed must be an integer in [0, 2**63 - 1]" in err and not out.exists()
    err = refused(capsys, ["verify", "--seed", str(2**70)])
    assert "--seed must be an integer in [0, 2**63 - 1]" in err


def test_the_largest_seed_is_accepted(capsys, tmp_path):
    out = tmp_path / "sweep"
    assert main(["sweep", "cpu-smoke", "--seeds", str(2**63 - 1), "--dry-run",
                 "--out", str(out)]) == 0
    assert not out.exists()


# ---- the attention scale --------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["1e-300", "1e30", "0.00009"])
def test_train_refuses_an_attention_scale_outside_its_bounds(capsys, data_dir, tmp_path,
                                                             scale):
    run = tmp_path / "run"
    args = ["train", "shakespeare-char", "--out", str(run),
            *sets(tiny_overrides(data_dir, f"model.attn_scale={scale}"))]
    assert "attn_scale must be a number in [0.0001, 10000]" in refused(capsys, args)
    assert not run.exists()


def test_a_rule_that_resolves_outside_the_bounds_is_refused(capsys):
    err = refused(capsys, ["params", "shakespeare-char", *sets(
        ["model.projection=q-identity", "model.attn_scale=matched", "model.init_std=1e-9"])])
    assert "attn_scale = matched gives" in err and "init_std" in err


def test_initial_weights_with_a_nan_loss_stop_before_training(capsys, data_dir, tmp_path):
    run = tmp_path / "run"
    args = ["train", "shakespeare-char", "--out", str(run),
            *sets(tiny_overrides(data_dir, "model.init_std=1e30"))]
    err = refused(capsys, args)
    assert "before any training step" in err and "not the learning rate" in err
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").open())] == [0]


# ---- the retrofit's closed share ------------------------------------------------------------
def gap_output(capsys, before: float, after_convert: float, after_heal: float) -> str:
    hc = HealConfig(steps=4)
    report = RetrofitReport(source=Path("src"), init="regress",
                            init_info=InitInfo("regress", "note"), heal_config=hc,
                            before=before,
                            heal_result=HealResult([(0, after_convert), (4, after_heal)]))
    capsys.readouterr()
    _print_report(report, hc, "q-identity")
    return next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("gap to the original"))


def test_retrofit_prints_no_share_of_a_gap_too_small_to_split(capsys):
    for after_heal in (2.0026, 1.95):  # the "-26390%" and "22325800%" of a gap of 1e-5
        line = gap_output(capsys, 2.0, 2.00001, after_heal)
        assert "%" not in line and "too small" in line
    line = gap_output(capsys, 2.0, 2.5, 2.1)  # a real gap keeps its share
    assert "80% closed" in line
