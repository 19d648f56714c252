"""`qkvlab verify` and `qkvlab convert` end to end."""

from __future__ import annotations

import time

import pytest
import torch

from qkvlab.cli import main
from qkvlab.data.prepare import prepare
from qkvlab.model.gpt import GPT
from qkvlab.theory.common import max_logit_diff
from qkvlab.theory.limits import small_config
from qkvlab.theory.verify import run_checks


def test_verify_prints_an_all_pass_table_in_under_a_minute(capsys):
    start = time.perf_counter()
    assert main(["verify", "--seed", "0"]) == 0
    assert time.perf_counter() - start < 60
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out


@pytest.mark.parametrize("seed", [1, 2])
def test_every_check_passes_for_other_seeds(seed):
    results = run_checks(seed)
    assert len(results) >= 25
    assert {r.expect for r in results} == {"exact", "obstruction"}
    for r in results:
        assert r.passed, (r.statement, r.hypotheses, r.value)
        if r.expect == "exact":
            assert r.value < 1e-10
        else:
            assert r.value > 1e-3  # far above rounding error, not a close call


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("theory-cli") / "shakespeare-char"
    prepare("shakespeare", "char", out, log=lambda _msg: None)
    return out


def _checkpoint(tmp_path, data_dir, **overrides):
    from qkvlab.run.checkpoint import write_checkpoint
    from qkvlab.run.config import DataConfig, RunConfig, TrainConfig

    cfg = small_config(**{"vocab_size": 65, "block_size": 32, "n_layer": 2,
                          "tie_embeddings": True, **overrides})
    torch.manual_seed(0)
    model = GPT(cfg)
    run = RunConfig(model=cfg, data=DataConfig(dir=str(data_dir)),
                    train=TrainConfig(eval_windows=8), name="t", out_dir=str(tmp_path / "run"))
    ckpt = write_checkpoint(tmp_path / "run" / "ckpt-0000010", model.state_dict(), run,
                            state={"step": 10})
    return model, ckpt


def test_convert_command_writes_a_regular_checkpoint(tmp_path, data_dir, capsys):
    from qkvlab.run.load import load_model

    model, ckpt = _checkpoint(tmp_path, data_dir)
    assert main(["convert", str(ckpt), "--to", "q-identity"]) == 0
    out = capsys.readouterr().out
    assert "saved 512" in out  # 2 layers x 16^2
    assert "max |logit diff| on 8 held-out windows" in out
    dest = tmp_path / "run" / "converted-q-identity"
    loaded, info = load_model(dest)
    assert loaded.cfg.projection == "q-identity" and info.state["kind"] == "converted"
    assert loaded.cfg.attn_scale == pytest.approx(model.cfg.scale)
    idx = torch.randint(65, (2, 32))
    assert max_logit_diff(model, loaded, idx) < 1e-4  # float32 storage
    # and it can be converted again only from a baseline model
    assert main(["convert", str(dest), "--to", "k-identity", "--out",
                 str(tmp_path / "again")]) == 2
    assert "projection=q-identity" in capsys.readouterr().err


def test_convert_command_refuses_outside_the_theorem(tmp_path, data_dir, capsys):
    _, ckpt = _checkpoint(tmp_path, data_dir, norm="layernorm", residual="full")
    assert main(["convert", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkvlab convert: error: section 3: normalization obstructs")
    assert "\n" not in err
    assert not (tmp_path / "run" / "converted-q-identity").exists()


def test_convert_command_never_overwrites_a_foreign_folder(tmp_path, data_dir, capsys):
    _, ckpt = _checkpoint(tmp_path, data_dir)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["convert", str(ckpt), "--out", str(foreign)]) == 2
    assert "not a qkvlab checkpoint folder" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert main(["convert", str(ckpt), "--to", "w-identity"]) == 2
