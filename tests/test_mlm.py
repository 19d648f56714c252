"""Masked-LM encoders: BERT masking, its determinism, the fixed eval mask, refusals, training."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_config
from qkvlab.data.prepare import prepare
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.run.metrics import read_metrics
from qkvlab.train import objectives
from qkvlab.train.distributed import DistContext
from qkvlab.train.trainer import train

WORDS = "to be or not that is the question whether tis nobler in the mind".split()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mlmdata")
    rng = random.Random(1)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(200))
    (root / "t.txt").write_text(text + "\n", encoding="utf-8")
    prepare(str(root / "t.txt"), "char", root / "char", val_fraction=0.1)
    return root / "char"


def vocab(data_dir: Path) -> int:
    return json.loads((data_dir / "meta.json").read_text())["vocab_size"]


def config(data_dir: Path, out: Path, *extra: str):
    """The tiny run as a bidirectional masked-LM encoder (one extra id: the mask token)."""
    return tiny_config(data_dir, "model.causal=false", "train.grad_accum=2",
                       "train.objective=mlm", f"run.out_dir={out}", *extra,
                       vocab=vocab(data_dir) + 1)


def test_masking_is_bert_style():
    tokens = torch.randint(0, 60, (64, 128), generator=torch.Generator().manual_seed(0))
    inputs, targets = objectives.mask_tokens(tokens, torch.Generator().manual_seed(1), 0.15, 60)
    selected = targets != -100
    assert abs(selected.float().mean().item() - 0.15) < 0.01
    assert torch.equal(targets[selected], tokens[selected])
    assert torch.equal(inputs[~selected], tokens[~selected])  # only selected positions change
    assert selected.any(dim=1).all()
    masked = (inputs == 60) & selected
    assert abs(masked.sum().item() / selected.sum().item() - 0.8) < 0.03
    kept = (inputs == tokens) & selected
    assert abs(kept.sum().item() / selected.sum().item() - (0.1 + 0.1 / 60)) < 0.03
    assert inputs.max().item() == 60 and (inputs[selected & ~masked] < 60).all()
    # one row of 2 tokens at a tiny probability still gets a target
    _, t = objectives.mask_tokens(torch.zeros(3, 2, dtype=torch.long),
                                  torch.Generator().manual_seed(2), 1e-6, 5)
    assert ((t != -100).sum(dim=1) >= 1).all()


def test_masks_are_deterministic_and_independent_of_the_process_count(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "r")
    x = torch.randint(0, vocab(data_dir), (8, 16))
    one = objectives.train_inputs(cfg, vocab(data_dir), x, x, step=3, micro_step=1)
    again = objectives.train_inputs(cfg, vocab(data_dir), x, x, step=3, micro_step=1)
    assert torch.equal(one[0], again[0]) and torch.equal(one[1], again[1])
    halves = [objectives.train_inputs(cfg, vocab(data_dir), x[p * 4:(p + 1) * 4], None,
                                      step=3, micro_step=1, part=p, parts=2) for p in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), one[0])
    assert torch.equal(torch.cat([h[1] for h in halves]), one[1])
    other = objectives.train_inputs(cfg, vocab(data_dir), x, x, step=4, micro_step=1)
    assert not torch.equal(other[1], one[1])
    # the eval mask does not depend on the run's seed: paired across runs and variants
    cfg2 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=7))
    e1 = objectives.eval_inputs(cfg, vocab(data_dir), x, x)
    e2 = objectives.eval_inputs(cfg2, vocab(data_dir), x, x)
    assert torch.equal(e1[0], e2[0]) and torch.equal(e1[1], e2[1])
    clm = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, causal=True),
                              train=dataclasses.replace(cfg.train, objective="clm"))
    assert objectives.train_inputs(clm, 5, x, x, 0, 0)[0] is x


def test_refusals(data_dir, tmp_path):
    with pytest.raises(QkvlabError, match="mlm needs a bidirectional encoder"):
        config(data_dir, tmp_path / "a", "model.causal=true")
    with pytest.raises(QkvlabError, match="train.objective must be one of clm, mlm"):
        config(data_dir, tmp_path / "a", "train.objective=span")
    with pytest.raises(QkvlabError, match="mlm_prob must be in"):
        config(data_dir, tmp_path / "a", "train.mlm_prob=1.5")
    small = config(data_dir, tmp_path / "a", f"model.vocab_size={vocab(data_dir)}")
    with pytest.raises(QkvlabError, match=rf"model.vocab_size >= {vocab(data_dir) + 1}"):
        train(small, quiet=True)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_encoder_trains_with_masked_eval_and_resumes_exactly(data_dir, tmp_path, capsys):
    straight = train(config(data_dir, tmp_path / "a"), quiet=True)
    train(config(data_dir, tmp_path / "b", "train.max_steps=4"), quiet=True)
    resumed = train(config(data_dir, tmp_path / "b"), resume=True, quiet=True)
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [(r["step"], r.get("loss"), r.get("val_loss"), r.get("val_acc")) for r in a] == \
        [(r["step"], r.get("loss"), r.get("val_loss"), r.get("val_acc")) for r in b]
    assert straight["final_val_loss"] == resumed["final_val_loss"]
    evals = [r for r in a if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert all(0 <= r["val_acc"] <= 1 for r in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]

    # the logged val loss is the token-weighted masked cross-entropy of the final weights
    from qkvlab.run.load import load_model, open_data

    cfg = config(data_dir, tmp_path / "a")
    model, _ = load_model(tmp_path / "a")
    data = open_data(cfg.data)
    x, y = data.val_windows(8, 16)
    xi, yt = objectives.eval_inputs(cfg, data.vocab_size, x, y)
    assert (xi == data.vocab_size).any()  # the [MASK] id appears in the inputs
    with torch.no_grad():
        logits, _ = model.eval()(xi)
    keep = yt != -100
    ce = F.cross_entropy(logits[keep], yt[keep]).item()
    acc = (logits.argmax(-1)[keep] == yt[keep]).float().mean().item()
    assert ce == pytest.approx(evals[-1]["val_loss"], rel=1e-5)
    assert acc == pytest.approx(evals[-1]["val_acc"])
    par = type("P", (), {"ctx": DistContext(torch.device("cpu")), "fwd": model})()
    assert objectives.evaluate_masked(par, xi, yt, 3, "fp32") == \
        (pytest.approx(ce, rel=1e-5), pytest.approx(acc))
    per_window = objectives.window_losses(model, xi, yt, 3, torch.device("cpu"), "fp32")
    assert len(per_window) == 8
    # the encoder sees to the right: a later token changes an earlier position's output
    probe = xi[:1].clone()
    before = model(probe)[0][0, 0]
    probe[0, -1] = (probe[0, -1] + 1) % data.vocab_size
    assert not torch.allclose(before, model(probe)[0][0, 0])
    assert isinstance(model, GPT) and not model.cfg.causal
    # `qkvlab eval` scores an encoder the way training did
    from qkvlab.cli import main

    capsys.readouterr()
    assert main(["eval", str(tmp_path / "a")]) == 0
    assert f"masked-token loss {evals[-1]['val_loss']:.4f}" in capsys.readouterr().out
