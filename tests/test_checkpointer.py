"""The Checkpointer on one process, and the one fault-injection hook of checkpoint writes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qkvlab.model import GPT
from qkvlab.run import checkpoint as ck
from qkvlab.run import layout, store
from qkvlab.run.config import load_config
from qkvlab.train.checkpointer import Checkpointer
from qkvlab.train.distributed import DistContext, Parallel, plan_batches
from qkvlab.train.optim import build_optimizer

TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=8",
        "model.vocab_size=20", "train.keep_last=2"]


@pytest.fixture
def setup(tmp_path):
    """(cfg, model, optimizer, checkpointer) of a 1 x 16 model with AdamW moments."""
    cfg = load_config("shakespeare-char", [*TINY, f"run.out_dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    x = torch.randint(0, 20, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    plan = plan_batches(cfg.train.batch_size, cfg.train.grad_accum, 1, 0)
    par = Parallel(model, DistContext(torch.device("cpu")), cfg.train.parallel, False, plan)
    return cfg, model, opt, Checkpointer(cfg.run_dir, cfg, par, opt)


@pytest.fixture
def stages(monkeypatch):
    """The stages the fault hook is called at, in order."""
    seen: list[str] = []

    def record(stage):
        assert stage in ck.WRITE_STAGES
        seen.append(stage)

    monkeypatch.setattr(ck, "on_write_stage", record)
    return seen


def test_save_writes_the_checkpoint_then_latest_then_prunes(setup, stages):
    cfg, _, _, cp = setup
    paths = [cp.save(step, {"tokens": step}) for step in (1, 2, 3)]
    assert paths[-1] == cfg.run_dir / "ckpt-0000003"
    assert [p.name for p in layout.list_checkpoints(cfg.run_dir)] == ["ckpt-0000002",
                                                                      "ckpt-0000003"]
    assert (cfg.run_dir / "latest").read_text().strip() == "ckpt-0000003"
    assert stages[:6] == ["model written", "optimizer written", "state written",
                          "manifest written", "checkpoint complete, latest not yet updated",
                          "latest updated, not yet pruned"]
    state = json.loads((paths[-1] / "state.json").read_text())
    assert (state["step"], state["kind"], state["tokens"]) == (3, "train", 3)
    assert "rng_ranks" not in state  # one process: its RNG is state["rng"]


def test_save_best_has_no_optimizer_and_replaces_the_old_one(setup, stages):
    cfg, _, _, cp = setup
    cp.save_best({"step": 2, "val_loss": 2.0})
    assert stages == ["model written", "state written", "manifest written"]
    stages.clear()
    best = cp.save_best({"step": 4, "val_loss": 1.5})
    assert "old checkpoint renamed aside" in stages
    info = store.read_checkpoint(best)
    assert info.step == 4 and info.state["kind"] == "best" and not info.has_optimizer
    assert not list(cfg.run_dir.glob(".old-*"))
    assert layout.list_checkpoints(cfg.run_dir) == []  # best/ is not a ckpt-*


def test_restore_gives_back_the_optimizer_and_rng_bitwise(setup):
    cfg, model, opt, cp = setup
    torch.manual_seed(7)
    path = cp.save(1, {})
    expected = torch.rand(4)
    info = store.read_checkpoint(path)
    model2 = GPT(cfg.model)
    ck.load_model_state(model2, info)
    opt2 = build_optimizer(model2, cfg.optim)
    plan = plan_batches(cfg.train.batch_size, cfg.train.grad_accum, 1, 0)
    par2 = Parallel(model2, DistContext(torch.device("cpu")), cfg.train.parallel, False, plan)
    Checkpointer(cfg.run_dir, cfg, par2, opt2).restore(info)
    assert torch.equal(torch.rand(4), expected)
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_restore_refuses_moments_of_another_shape(setup):
    cfg, model, opt, cp = setup
    info = store.read_checkpoint(cp.save(1, {}))
    current = opt.state_dict()
    shapes = [tuple(p.shape) for g in opt.param_groups for p in g["params"]]
    shapes[0] = (shapes[0][0] + 1, *shapes[0][1:])
    with pytest.raises(ck.CorruptCheckpoint, match=r"state\.0\.exp_avg has shape"):
        ck.read_optimizer_state(info, current, shapes)
    assert ck.read_optimizer_state(info, current, None)["param_groups"]  # unchecked: loads


def test_weights_finite(setup):
    _, model, _, cp = setup
    assert cp.weights_finite()
    with torch.no_grad():
        model.wte.weight[0, 0] = math.inf
    assert not cp.weights_finite()


class Crash(BaseException):
    """A crash at a stage (BaseException, as KeyboardInterrupt is)."""


@pytest.mark.parametrize("stage", ck.WRITE_STAGES)
def test_a_crash_at_any_stage_loses_no_checkpoint(setup, monkeypatch, stage):
    cfg, _, _, cp = setup
    cp.save(1, {})
    cp.save(2, {})
    cp.save_best({"step": 2})

    def crash(at):
        if at == stage:
            raise Crash(at)

    monkeypatch.setattr(ck, "on_write_stage", crash)
    with pytest.raises(Crash):
        if stage == "old checkpoint renamed aside":
            cp.save(2, {})  # only a folder that exists already is renamed aside
        else:
            cp.save(3, {})
    store.clean_temp(cfg.run_dir)  # what the next run does first
    kept = layout.list_checkpoints(cfg.run_dir)
    for path in [*kept, cfg.run_dir / "best"]:
        ck.verify_checkpoint(path)
    assert {"ckpt-0000002"} <= {p.name for p in kept}
    newest = store.read_checkpoint(cfg.run_dir)
    assert newest.step >= 2  # what a resume picks up is no older than before
    assert not [p for p in cfg.run_dir.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_the_environment_switch_sleeps_at_every_stage(monkeypatch):
    naps: list[float] = []
    monkeypatch.setattr(ck.time, "sleep", naps.append)
    monkeypatch.delenv(ck.SLOW_CKPT_ENV, raising=False)
    ck.on_write_stage("model written")
    for ignored in ("", "0", "-1", "60", "soon"):
        monkeypatch.setenv(ck.SLOW_CKPT_ENV, ignored)
        ck.on_write_stage("model written")
    assert naps == []
    monkeypatch.setenv(ck.SLOW_CKPT_ENV, "0.04")
    for stage in ck.WRITE_STAGES:
        ck.on_write_stage(stage)
    assert naps == [0.04] * len(ck.WRITE_STAGES)
    with pytest.raises(AssertionError):
        ck.on_write_stage("a stage nobody named")


def test_the_environment_switch_is_read_in_one_place():
    from pathlib import Path

    src = Path(ck.__file__).resolve().parents[1]
    readers = [p.relative_to(src).as_posix() for p in src.rglob("*.py")
               if "SLOW_CKPT" in p.read_text(encoding="utf-8")]
    assert readers == ["run/checkpoint.py"]
