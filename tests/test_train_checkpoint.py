"""Checkpoints: atomic folders, manifest verification, corruption, pickle refusal, reloading."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch

from qkvlab.errors import QkvlabError
from qkvlab.fsutil import sha256_file
from qkvlab.model import GPT
from qkvlab.run import checkpoint as ck
from qkvlab.run import layout, load, rng, store
from qkvlab.run.config import as_recorded, load_config
from qkvlab.train.checkpointer import Checkpointer
from qkvlab.train.distributed import DistContext, Parallel, plan_batches
from qkvlab.train.optim import build_optimizer

TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "model.vocab_size=40"]


def tiny(tmp_path: Path, *extra: str):
    cfg = load_config("shakespeare-char", [*TINY, f"run.out_dir={tmp_path / 'run'}",
                                           "train.keep_last=3", *extra])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    x = torch.randint(0, 40, (2, 16))
    for _ in range(2):  # populate AdamW's moments
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return cfg, model, opt


def checkpointer(cfg, model, opt) -> Checkpointer:
    """The single-process Checkpointer of `model` (keep_last: cfg.train.keep_last)."""
    plan = plan_batches(cfg.train.batch_size, cfg.train.grad_accum, 1, 0)
    par = Parallel(model, DistContext(torch.device("cpu")), cfg.train.parallel, False, plan)
    return Checkpointer(cfg.run_dir, cfg, par, opt)


def save(cfg, model, opt, step: int) -> Path:
    return checkpointer(cfg, model, opt).save(step, {"tokens": step * 10, "best_val_loss": 2.5})


def test_layout_manifest_and_latest(tmp_path):
    cfg, model, opt = tiny(tmp_path)
    path = save(cfg, model, opt, 5)
    assert path.name == "ckpt-0000005"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "model.safetensors", "optimizer.safetensors", "state.json"]
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        assert (path / name).stat().st_size == entry["size"]
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
    assert (cfg.run_dir / "latest").read_text().strip() == "ckpt-0000005"
    assert not list(cfg.run_dir.glob(".tmp-ckpt-*"))
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 5 and state["tokens"] == 50 and state["best_val_loss"] == 2.5
    assert state["config"]["model"]["n_embd"] == 32 and "torch" in state["rng"]
    assert state["qkvlab_version"]
    ck.verify_checkpoint(path)


def test_tied_head_is_stored_once_and_retied(tmp_path):
    from safetensors import safe_open

    cfg, model, opt = tiny(tmp_path)
    path = save(cfg, model, opt, 1)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "wte.weight" in keys
    loaded, info = load.load_model(cfg.run_dir)
    assert loaded.lm_head.weight is loaded.wte.weight
    assert info.step == 1 and info.config == as_recorded(cfg) and not loaded.training
    x = torch.randint(0, 40, (2, 16))
    model.eval()
    assert torch.equal(loaded(x)[0], model(x)[0])

    cfg2, model2, opt2 = tiny(tmp_path / "untied", "model.tie_embeddings=false")
    path2 = save(cfg2, model2, opt2, 1)
    with safe_open(str(path2 / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in set(f.keys())
    loaded2, _ = load.load_model(path2)
    assert torch.equal(loaded2.lm_head.weight, model2.lm_head.weight)


def test_optimizer_and_rng_round_trip_bitwise(tmp_path):
    cfg, model, opt = tiny(tmp_path)
    torch.manual_seed(123)
    path = save(cfg, model, opt, 2)
    expected_next = torch.rand(3)
    info = store.read_checkpoint(path)
    model2 = GPT(cfg.model)
    ck.load_model_state(model2, info)
    opt2 = build_optimizer(model2, cfg.optim)
    checkpointer(cfg, model2, opt2).restore(info)  # the optimizer and the RNG
    assert torch.equal(torch.rand(3), expected_next)
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for idx in a["state"]:
        for name, value in a["state"][idx].items():
            assert torch.equal(value, b["state"][idx][name]), (idx, name)
    assert a["param_groups"] == b["param_groups"]
    rng.set_rng_state(info.state["rng"])
    assert torch.equal(torch.rand(3), expected_next)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    cfg, model, opt = tiny(tmp_path, "train.keep_last=2")
    for step in (1, 2, 3, 4):
        save(cfg, model, opt, step)
    assert [p.name for p in layout.list_checkpoints(cfg.run_dir)] == ["ckpt-0000003",
                                                                      "ckpt-0000004"]
    assert store.find_checkpoint(cfg.run_dir).name == "ckpt-0000004"
    # resaving an existing step replaces it atomically
    save(cfg, model, opt, 4)
    ck.verify_checkpoint(cfg.run_dir / "ckpt-0000004")
    assert not list(cfg.run_dir.glob(".old-*"))


def test_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg, model, opt = tiny(tmp_path)
    save(cfg, model, opt, 1)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "rng_state", boom)  # fails after the tensors are written
    with pytest.raises(OSError, match="disk full"):
        save(cfg, model, opt, 2)
    assert not (cfg.run_dir / "ckpt-0000002").exists()
    assert not list(cfg.run_dir.glob(".tmp-ckpt-*"))
    assert (cfg.run_dir / "latest").read_text().strip() == "ckpt-0000001"
    ck.verify_checkpoint(cfg.run_dir / "ckpt-0000001")


def test_clean_temp_restores_a_checkpoint_renamed_aside(tmp_path):
    cfg, model, opt = tiny(tmp_path)
    path = save(cfg, model, opt, 1)
    # a crash between "rename the old folder aside" and "rename the new one in"
    path.rename(cfg.run_dir / ".old-ckpt-0000001-abcd1234")
    (cfg.run_dir / ".tmp-ckpt-ckpt-0000001-1-deadbeef").mkdir()
    store.clean_temp(cfg.run_dir)
    ck.verify_checkpoint(path)
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["ckpt-0000001", "latest"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corruption_is_detected_and_names_the_previous_good(tmp_path, damage):
    cfg, model, opt = tiny(tmp_path)
    save(cfg, model, opt, 1)
    bad = save(cfg, model, opt, 2)
    target = bad / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        (bad / "manifest.json").write_text("{not json")
    with pytest.raises(ck.CorruptCheckpoint) as err:
        load.load_model(cfg.run_dir)  # `latest` names the damaged one
    msg = str(err.value)
    assert f"checkpoint {bad} is corrupt" in msg
    assert "model.safetensors" in msg or "manifest.json" in msg
    assert "previous good checkpoint is" in msg and "ckpt-0000001" in msg
    # without `latest`, a run folder falls back to the newest checkpoint that verifies
    (cfg.run_dir / "latest").unlink()
    assert store.find_checkpoint(cfg.run_dir).name == "ckpt-0000001"


def test_pickle_files_are_refused_and_never_loaded(tmp_path, monkeypatch):
    cfg, model, opt = tiny(tmp_path)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    pt = tmp_path / "model.pt"
    torch.save(model.state_dict(), pt)
    with pytest.raises(QkvlabError, match="never unpickles"):
        load.load_model(pt)
    folder = tmp_path / "legacy"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "ckpt.pt")
    with pytest.raises(QkvlabError, match=r"found ckpt.pt: pickle files are never loaded"):
        load.load_model(folder)
    # a pickle smuggled in as model.safetensors, with a manifest that matches it
    path = save(cfg, model, opt, 1)
    torch.save(model.state_dict(), path / "model.safetensors")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {
        "size": (path / "model.safetensors").stat().st_size,
        "sha256": sha256_file(path / "model.safetensors")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ck.CorruptCheckpoint, match="not readable model safetensors"):
        load.load_model(path)


def test_no_unpickling_anywhere_in_the_package():
    src = Path(__file__).resolve().parents[1] / "src" / "qkvlab"
    for py in src.rglob("*.py"):
        text = py.read_text(encoding="utf-8")
        assert "torch.load(" not in text, py
        assert "pickle.load" not in text, py


def test_incompatible_config_is_refused(tmp_path):
    cfg, model, opt = tiny(tmp_path)
    path = save(cfg, model, opt, 1)
    info = store.read_checkpoint(path)
    other = GPT(load_config("shakespeare-char", [*TINY, "model.n_embd=64"]).model)
    with pytest.raises(QkvlabError, match=r"does not fit the model config \(.*wte.weight is "
                                          r"\[40, 32\] in the checkpoint but \[40, 64\]"):
        ck.load_model_state(other, info)
    qid = GPT(load_config("shakespeare-char", [*TINY, "model.projection=q-identity"]).model)
    with pytest.raises(QkvlabError, match="does not fit the model config"):
        ck.load_model_state(qid, info)


def test_best_checkpoint_has_no_optimizer(tmp_path):
    cfg, model, opt = tiny(tmp_path)
    best = ck.write_checkpoint(cfg.run_dir / "best", model.state_dict(), cfg, state={"step": 3})
    assert not (best / "optimizer.safetensors").exists()
    info = store.read_checkpoint(best)
    assert not info.has_optimizer and info.step == 3
    with pytest.raises(QkvlabError, match="no optimizer state"):
        ck.read_optimizer_state(info, opt.state_dict())
    # a run folder with only best/ still finds it
    assert store.find_checkpoint(cfg.run_dir) == best
    with pytest.raises(QkvlabError, match="does not exist"):
        store.find_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QkvlabError, match="no qkvlab checkpoint"):
        store.find_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["022", "002"])
def test_weights_follow_the_umask_like_the_other_files(tmp_path, mask):
    """safetensors writes 0600; a shared run folder's other users must be able to load them."""
    old = os.umask(mask)
    try:
        cfg, model, opt = tiny(tmp_path)
        path = save(cfg, model, opt, 5)
        (tmp_path / "plain.txt").write_text("x")  # what any file created now gets
    finally:
        os.umask(old)
    expected = 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == expected
    for name in ("model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"):
        assert stat.S_IMODE((path / name).stat().st_mode) == expected, name
