"""Retrofitting a trained baseline to W_Q = I: the inits' math, healing, the command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import tiny_config
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.model.attention_layout import Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.model.params import count_params
from qkvlab.retrofit.checkpoint import retrofit_checkpoint
from qkvlab.retrofit.heal import HealConfig, distill_loss
from qkvlab.retrofit.init import attention_moments, build_student
from qkvlab.run.load import load_model
from qkvlab.theory.common import random_model
from qkvlab.train.trainer import train


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    """A 2 x 32 standard pre-LN GPT (full skips, LayerNorm) trained for 40 steps."""
    run = tmp_path_factory.mktemp("runs") / "base"
    cfg = tiny_config(data_dir, "optim.warmup_steps=4", "train.max_steps=40",
                      "train.batch_size=8", "train.eval_interval=40", "train.ckpt_interval=40",
                      "train.log_interval=10", f"run.out_dir={run}")
    train(cfg, quiet=True)
    return run


def _block_diagonal_query(model: GPT, seed: int) -> None:
    """Make every W_Q^(h) read only slice h of its input (the case regress is exact for)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    dk = cfg.d_head
    with torch.no_grad():
        for blk in model.blocks:
            wq = torch.zeros(cfg.n_embd, cfg.n_embd, dtype=torch.float64)
            for h in range(cfg.n_head):
                sl = slice(h * dk, (h + 1) * dk)
                wq[sl, sl] = torch.randn(dk, dk, generator=g, dtype=torch.float64) / dk ** 0.5
            b_q = blk.attn.projections().b_q
            blk.attn.load_projections(Projections(  # Linear rows = paper columns
                w_q=wq.T, b_q=None if b_q is None else torch.zeros_like(b_q)))


@pytest.mark.parametrize("kw", [dict(), dict(bias=True), dict(tie_embeddings=False, n_layer=3),
                                dict(share_layers=True), dict(norm="rmsnorm")])
def test_regress_is_exact_when_each_head_reads_its_own_slice(kw):
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=16, block_size=12, vocab_size=20,
                                mlp_hidden=32), **kw})
    model = random_model(cfg, seed=3)
    _block_diagonal_query(model, seed=4)
    batches = [torch.randint(20, (4, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    student, info = build_student(model, "regress", attention_moments(model, batches), ridge=0)
    assert student.cfg.projection == "q-identity"
    assert student.cfg.scale == pytest.approx(model.cfg.scale / 2)  # the paper's halved scale
    assert min(info.query_r2) > 1 - 1e-9
    idx = torch.randint(20, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert float((student(idx)[0] - model(idx)[0]).abs().max()) < 1e-9


def test_inits_have_the_q_identity_shape():
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=16, block_size=12, vocab_size=20)
    model = random_model(cfg, seed=0)
    moments = attention_moments(model, [torch.randint(20, (2, 12))])
    target = count_params(ModelConfig(**{**cfg.to_dict(), "projection": "q-identity"})).total
    for init in ("regress", "basis", "drop"):
        student, info = build_student(model, init, moments)
        assert student.cfg.projection == "q-identity", init
        assert sum(p.numel() for p in student.parameters()) == target, init
        assert info.note


def test_refusals():
    q = random_model(ModelConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=10,
                                 projection="q-identity"), seed=0)
    with pytest.raises(QkvlabError, match="projection=baseline"):
        build_student(q, "drop")
    gqa = random_model(ModelConfig(n_layer=1, n_head=4, n_embd=8, block_size=4, vocab_size=10,
                                   n_kv_head=2), seed=0)
    with pytest.raises(QkvlabError, match="grouped-query"):
        build_student(gqa, "regress", attention_moments(gqa, [torch.randint(10, (1, 4))]))
    build_student(gqa, "drop")  # dropping W_Q needs no per-head keys
    with pytest.raises(QkvlabError, match="not one of"):
        build_student(gqa, "magic")
    with pytest.raises(QkvlabError, match="steps"):
        HealConfig(steps=-1)


def test_distill_loss_is_zero_against_itself():
    logits = torch.randn(2, 5, 11)
    assert float(distill_loss(logits, logits)) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_loss(logits, torch.randn(2, 5, 11))) > 0


@pytest.mark.slow
@pytest.mark.parametrize("distill", [False, True])
def test_retrofit_checkpoint_heals_and_writes(trained, tmp_path, distill):
    hc = HealConfig(steps=6, batch_size=8, lr=1e-3, eval_every=3, distill=distill)
    report = retrofit_checkpoint(trained, heal_config=hc, out=tmp_path / "rf", windows=8,
                                 calib_batches=2, compare_inits=True, device="cpu", log=None)
    assert [s for s, _ in report.heal_result.curve] == [0, 3, 6]
    assert set(report.other_inits) == {"basis", "drop"}
    assert all(v is not None and v > 0 for v in report.other_inits.values())
    # CE healing lowers the val loss; distillation chases the teacher's loss, which this
    # barely trained student already matches, so it only has to stay close
    assert report.after_heal <= report.after_convert + (1e-2 if distill else 1e-6)
    model, ckpt = load_model(tmp_path / "rf")
    assert model.cfg.projection == "q-identity"
    assert ckpt.state["kind"] == "retrofit"
    assert ckpt.state["retrofit"]["val_loss_after_heal"] == pytest.approx(report.after_heal)
    assert (tmp_path / "rf" / "tokenizer" / "meta.json").is_file()
    assert "| original (learned W_Q) |" in report.table()


@pytest.mark.slow
def test_cli_retrofit(trained, tmp_path, capsys):
    out = tmp_path / "rf"
    assert main(["retrofit", str(trained), "--to", "q-identity", "--steps", "2",
                 "--windows", "4", "--calib-batches", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| converted, init regress | 0 |" in text and "gap to the original" in text
    # a W_Q = I checkpoint is not a retrofit source: one line, exit 2
    assert main(["retrofit", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "projection=baseline" in err and "\n" not in err
