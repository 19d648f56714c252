"""The Llama-style block (RMSNorm, SwiGLU, RoPE) as a qkvlab model: its presets train, every
projection scheme its theory allows builds, and `qkvlab bench` times it."""

from __future__ import annotations

import json

import pytest
import torch

from qkvlab.bench.run import SHAPES
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.model.params import count_params
from qkvlab.model.variants import compare_variants
from qkvlab.run.config import load_config


@pytest.mark.parametrize("preset", ["shakespeare-char-llama", "shakespeare-char-llama-qidentity"])
def test_llama_presets_train(tmp_path, data_dir, preset):
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    out = tmp_path / "run"
    assert main(["train", preset, "--out", str(out), "--set", "model.n_layer=2",
                 "--set", "model.n_embd=64", "--set", "model.n_head=2",
                 "--set", "model.block_size=32", "--set", f"model.vocab_size={vocab}",
                 "--set", f"data.dir={data_dir}", "--set", "data.prepare_if_missing=false",
                 "--set", "train.max_steps=4", "--set", "train.batch_size=4",
                 "--set", "train.eval_interval=2", "--set", "train.eval_windows=4",
                 "--set", "train.tensorboard=false", "--set", "train.dtype=fp32"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_loss"] is not None
    cfg = load_config(out)
    assert (cfg.model.norm, cfg.model.mlp, cfg.model.positions) == ("rmsnorm", "swiglu", "rope")
    assert cfg.model.hidden == 64 * round(2 / 3 * 4 * 64 / 64)  # 2/3 of 4d, multiple of 64


@pytest.mark.parametrize("projection", ["baseline", "q-identity", "k-identity", "v-identity",
                                        "nonlinear-q"])
def test_every_scheme_builds_llama_style(projection):
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=16, norm="rmsnorm",
                      mlp="swiglu", positions="rope", projection=projection)
    model = GPT(cfg)
    idx = torch.randint(cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, cfg.vocab_size) and torch.isfinite(loss)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_gqa_refuses_identity_keys_with_the_reason():
    with pytest.raises(QkvlabError, match="n_kv_head == n_head"):
        ModelConfig(n_head=4, n_kv_head=2, n_embd=64, mlp="swiglu", projection="k-identity")


def test_reallocated_swiglu_keeps_the_parameter_count():
    base = ModelConfig(n_layer=4, n_head=4, n_embd=256, mlp="swiglu", norm="rmsnorm",
                       positions="rope")
    by_name = {v.name: v.model for v in compare_variants(base)}
    for q_identity in ("q-identity", "q-identity-tuned"):
        saved = count_params(base).total - count_params(by_name[q_identity]).total
        assert saved == 4 * 256 * 256
    wide = by_name["q-identity-tuned-wide"]
    gap = count_params(base).total - count_params(wide).total
    assert wide.hidden == 704 + 85 and 0 <= gap < 4 * 3 * 256


def test_bench_times_llama_shapes(capsys):
    assert SHAPES["baby-llama"].model["mlp"] == "swiglu"
    assert main(["bench", "--shape", "tiny-llama", "--schemes", "baseline,q-identity",
                 "--repeats", "2", "--steps", "1", "--warmup", "1", "--no-inference"]) == 0
    out = capsys.readouterr().out
    assert "q-identity" in out and "Speed-up over baseline" in out
