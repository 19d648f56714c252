"""Run configs (TOML, presets, overrides, round trips), the lr schedule and AdamW groups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from qkvlab.errors import QkvlabError
from qkvlab.model import GPT, ModelConfig
from qkvlab.model.params import count_params
from qkvlab.run.config import (
    OptimConfig,
    RunConfig,
    as_recorded,
    load_config,
    parse_override,
    preset_names,
    save_config,
)
from qkvlab.train.optim import build_optimizer, lr_at, param_groups

PRESETS = ("shakespeare-char", "gpt2-small-owt", "gpt2-small-owt-qidentity")


def test_presets_ship_and_round_trip(tmp_path):
    names = preset_names()
    for name in PRESETS:
        assert name in names
    for name in names:
        cfg = load_config(name)
        path = save_config(cfg, tmp_path / f"{name}.toml")
        assert load_config(path) == cfg
        assert load_config(f"{name}.toml") == cfg  # the .toml suffix is optional


def test_paper_presets_match_section_5():
    base = load_config("gpt2-small-owt")
    red = load_config("gpt2-small-owt-qidentity")
    m = base.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size) == (12, 12, 768, 1024, 50304)
    assert not m.bias and m.dropout == 0 and m.tie_embeddings
    o = base.optim
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_steps) == (6e-4, 6e-5, 2000, 600000)
    assert (o.beta1, o.beta2, o.grad_clip, o.weight_decay) == (0.9, 0.95, 1.0, 0.1)
    assert base.tokens_per_step == 491_520 and base.train.dtype == "bf16"
    assert count_params(m).total == 124_373_760
    assert red.model.projection == "q-identity" and red.model.attn_scale == "paper"
    assert red.model.scale == pytest.approx(0.0625)
    assert red.optim.weight_decay == 0.03125
    assert count_params(red.model).total == 117_295_872
    baby = load_config("shakespeare-char")
    assert (baby.model.n_layer, baby.model.n_embd, baby.model.block_size) == (6, 384, 256)
    assert baby.train.dtype == "auto" and baby.data.tokenizer == "char"


def test_overrides_parse_toml_literals():
    cfg = load_config("shakespeare-char", [
        "optim.lr=3e-4", "model.projection=q-identity", "train.compile=true",
        "train.max_steps=7", "run.out_dir=runs/x y", 'data.dir="data/z"', "optim.min_lr=0",
    ])
    assert cfg.optim.lr == 3e-4 and cfg.model.projection == "q-identity"
    assert cfg.train.compile is True and cfg.train.max_steps == 7
    assert cfg.out_dir == "runs/x y" and cfg.data.dir == "data/z"
    assert cfg.optim.min_lr == 0.0 and isinstance(cfg.optim.min_lr, float)
    assert parse_override("a.b = 1") == ("a", "b", 1)
    # text fields keep text that TOML would read as a number
    named = load_config("shakespeare-char", ["run.name=2024", "data.dir=1e3"])
    assert named.name == "2024" and named.data.dir == "1e3"


@pytest.mark.parametrize("override, needle", [
    ("model.n_layers=2", "unknown key(s) n_layers in [model]; valid keys: n_layer"),
    ("train.bogus=1", "valid keys: max_steps"),
    ("trian.max_steps=1", "unknown section 'trian'"),
    ("train.max_steps=1.5", "train.max_steps must be int"),
    ("train.max_steps=ten", "train.max_steps must be int"),
    ("optim.lr=fast", "optim.lr must be float"),
    ("train.compile=yes", "train.compile must be bool"),
    ("train.dtype=fp16", "train.dtype must be one of auto, bf16, fp32"),
    ("optim.min_lr=1.0", "optim.min_lr must be in [0, lr"),
    ("model.n_head=5", "divisible"),
    ("lr=1", "is not section.key=value"),
    ("train.max_steps", "is not section.key=value"),
])
def test_bad_overrides_name_the_problem(override, needle):
    with pytest.raises(QkvlabError) as err:
        load_config("shakespeare-char", [override])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_steps = __import__('os').system('echo hi')\n")
    with pytest.raises(QkvlabError, match="not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[training]\nmax_steps = 3\n")
    with pytest.raises(QkvlabError, match="unknown section.*training.*valid sections"):
        load_config(unknown)
    with pytest.raises(QkvlabError, match="neither a file nor a preset.*shakespeare-char"):
        load_config(tmp_path / "missing.toml")
    notable = tmp_path / "notable.toml"
    notable.write_text("train = 3\n")
    with pytest.raises(QkvlabError, match=r"\[train\] must be a table"):
        load_config(notable)


def test_partial_file_takes_defaults_and_run_folder_loads(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = "x"\n[model]\nn_layer = 2\n')
    cfg = load_config(path)
    assert cfg.model.n_layer == 2 and cfg.model.n_embd == 384 and cfg.run_dir.as_posix() == "runs/x"
    run = tmp_path / "run"
    run.mkdir()
    save_config(as_recorded(cfg), run / "config.toml")
    # the record leaves out the folder holding it; read as a run folder, the folder is out_dir
    assert "out_dir" not in (run / "config.toml").read_text()
    assert load_config(run) == replace(cfg, out_dir=str(run))
    assert load_config(run / "config.toml") == cfg


def test_round_trip_keeps_none_and_optional_values(tmp_path):
    cfg = load_config("shakespeare-char", ["model.attn_scale=0.1", "model.n_kv_head=2",
                                           "train.peak_flops=1e12", "train.compile=false"])
    back = load_config(save_config(cfg, tmp_path / "c.toml"))
    assert back == cfg and back.model.attn_scale == 0.1 and back.train.compile is False
    assert back.optim.eps == cfg.optim.eps and back.train.eval_batch_size is None
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_lr_schedule():
    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=110)
    assert lr_at(0, o) == pytest.approx(1e-4)
    assert lr_at(9, o) == pytest.approx(1e-3)  # peak reached at the end of warmup
    assert lr_at(10, o) == pytest.approx(1e-3)
    assert lr_at(60, o) == pytest.approx(5.5e-4)  # half way down the cosine
    assert lr_at(110, o) == pytest.approx(1e-4)
    assert lr_at(10_000, o) == pytest.approx(1e-4)  # constant after the horizon
    lrs = [lr_at(s, o) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    # decay_steps unset: the horizon is max_steps
    o2 = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=None)
    assert lr_at(50, o2, max_steps=100) == pytest.approx(5e-4)
    # the paper: horizon 600k, stopped at 105k, lr still ~94% of peak
    paper = load_config("gpt2-small-owt").optim
    assert lr_at(105_000, paper) / paper.lr == pytest.approx(0.935, abs=0.01)
    with pytest.raises(QkvlabError, match="decay_steps"):
        OptimConfig(warmup_steps=10, decay_steps=5)


def test_weight_decay_groups_and_optimizer():
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
    model = GPT(cfg)
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1))
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert any(p is model.wte.weight for p in decay["params"])
    assert any(p is model.wpe.weight for p in decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == count_params(cfg).total  # the tied head is counted once
    opt = build_optimizer(model, load_config("shakespeare-char", ["optim.weight_decay=0.03"]).optim)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.03, 0.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert math.isclose(opt.param_groups[0]["eps"], 1e-8)
