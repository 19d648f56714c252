"""The parametrization table (μP): roles, init, optimizer groups, multipliers, export."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import config_identity
from qkvlab.model import GPT, ModelConfig
from qkvlab.model.parametrization import (
    folded_for_export,
    parameter_table,
    readout_multiplier,
)
from qkvlab.run.config import OptimConfig, RunConfig
from qkvlab.train.optim import build_optimizer, param_groups, set_lr

BASE = dict(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=50)
SCHEMES = [dict(projection=p) for p in ("baseline", "q-identity", "k-identity", "v-identity",
                                        "nonlinear-q")] + [
    dict(n_head=4, n_kv_head=2), dict(mlp="swiglu", norm="rmsnorm", positions="rope"),
    dict(tie_embeddings=False, bias=True), dict(causal=False), dict(attn_scale="learned")]


def cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def groups_of(model: GPT, opt: OptimConfig) -> dict[int, dict]:
    """parameter id -> its optimizer group."""
    return {id(p): g for g in param_groups(model, opt) for p in g["params"]}


@pytest.mark.parametrize("kw", SCHEMES)
def test_every_parameter_has_one_role_and_one_group(kw):
    for par in ("standard", "mup"):
        model = GPT(cfg(parametrization=par, base_width=32, **kw))
        rows = parameter_table(model, model.cfg)
        names = [n for n, _ in model.named_parameters()]
        assert [r.name for r in rows] == names
        assert {r.role for r in rows} <= {"embedding", "hidden", "readout", "gain"}
        grouped = [p for g in param_groups(model, OptimConfig()) for p in g["params"]]
        assert len(grouped) == len(names) and {id(p) for p in grouped} == \
            {id(p) for p in model.parameters()}


def test_standard_is_two_groups_of_factor_one():
    model = GPT(cfg())
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1, lr=3e-3))
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decay["lr_scale"] == no_decay["lr_scale"] == 1.0 and decay["lr"] == 3e-3
    assert all(r.scaling == type(r.scaling)() for r in parameter_table(model, model.cfg)
               if r.decays)


@pytest.mark.parametrize("kw", SCHEMES)
def test_mup_at_the_base_shape_is_standard(kw):
    torch.manual_seed(0)
    sp = GPT(cfg(**kw))
    torch.manual_seed(0)
    mup = GPT(cfg(parametrization="mup", **kw))  # base_width unset: the model's own width
    for (n, a), (_, b) in zip(sp.state_dict().items(), mup.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    opt = OptimConfig(weight_decay=0.1)
    assert [(g["lr"], g["weight_decay"], g["eps"]) for g in param_groups(sp, opt)] == \
        [(g["lr"], g["weight_decay"], g["eps"]) for g in param_groups(mup, opt)]


def test_mup_width_rules():
    """At 4x the base width: hidden init std / 2, Adam lr / 4 with lr x decay kept, eps / 4;
    embeddings as at the base; an untied head 1/4 in init, lr and eps."""
    torch.manual_seed(0)
    c = cfg(n_embd=256, n_head=4, parametrization="mup", base_width=64, tie_embeddings=False)
    model = GPT(c)
    opt = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-8)
    groups = groups_of(model, opt)
    w = model.blocks[0].attn.in_proj.weight
    assert w.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    g = groups[id(w)]
    assert g["lr"] == pytest.approx(1e-2 / 4) and g["eps"] == pytest.approx(1e-8 / 4)
    assert g["lr"] * g["weight_decay"] == pytest.approx(1e-2 * 0.1)  # independent decay
    assert model.lm_head.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert groups[id(model.lm_head.weight)]["lr"] == pytest.approx(1e-2 / 4)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert groups[id(model.wte.weight)]["lr"] == pytest.approx(1e-2)
    assert groups[id(model.blocks[0].norm1.weight)]["weight_decay"] == 0.0
    # GPT-2's residual init, at the width factor
    out = model.blocks[0].attn.out_proj.weight.std().item()
    assert out == pytest.approx(0.02 / math.sqrt(2 * 2) / 2, rel=0.05)


def test_set_lr_keeps_each_groups_factor():
    model = GPT(cfg(n_embd=128, parametrization="mup", base_width=64))
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    set_lr(opt, 4e-3)
    assert sorted({g["lr"] for g in opt.param_groups}) == pytest.approx([2e-3, 4e-3])


def test_a_tied_head_carries_the_readout_multiplier_and_export_folds_it():
    torch.manual_seed(0)
    model = GPT(cfg(n_embd=128, n_head=4, parametrization="mup", base_width=32))
    assert readout_multiplier(model.cfg) == 0.25 and model.readout_mult == 0.25
    idx = torch.randint(0, 50, (2, 16))
    logits, _ = model(idx)
    h = model.hidden_states(idx)
    assert torch.allclose(logits, model.lm_head(h) / 4, atol=1e-6)
    folded_cfg, sd = folded_for_export(model)
    assert not folded_cfg.tie_embeddings and readout_multiplier(folded_cfg) == 1.0
    plain = GPT(folded_cfg)
    plain.load_state_dict(sd)
    assert torch.allclose(plain(idx)[0], logits, atol=1e-6)


@pytest.mark.parametrize("rule,alpha", [("depth-mup", 0.5), ("completep", 1.0)])
def test_depth_rules_fold_the_branch_multiplier(rule, alpha):
    """At 4x the base depth the branch multiplier 4^-alpha folds into out_proj and fc_out:
    init and lr times it; hidden lr times 4^(alpha - 1); gains' lr too."""
    torch.manual_seed(0)
    c = cfg(n_layer=8, base_depth=2, depth_scaling=rule, n_embd=128, n_head=2)
    model = GPT(c)
    groups = groups_of(model, OptimConfig(lr=1.0))
    mult = 4 ** -alpha
    depth_lr = 4 ** (alpha - 1)
    fc_out = model.blocks[0].mlp.fc_out.weight
    assert fc_out.std().item() == pytest.approx(0.02 / math.sqrt(2 * 2) * mult, rel=0.05)
    assert groups[id(fc_out)]["lr"] == pytest.approx(depth_lr * mult)
    assert groups[id(model.blocks[0].mlp.fc_in.weight)]["lr"] == pytest.approx(depth_lr)
    assert groups[id(model.blocks[0].norm1.weight)]["lr"] == pytest.approx(depth_lr)
    assert groups[id(model.wte.weight)]["lr"] == 1.0
    # depth-μP's init of the residual outputs is GPT-2's own at the new depth
    if rule == "depth-mup":
        assert fc_out.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)


@pytest.mark.parametrize("projection,zero", [("baseline", "query"), ("q-identity", "key"),
                                             ("nonlinear-q", "key"), ("k-identity", "query")])
def test_zero_init_makes_attention_uniform(projection, zero):
    torch.manual_seed(0)
    model = GPT(cfg(projection=projection, attn_zero_init=zero, parametrization="mup"))
    x = model.blocks[0].norm1(model.wte(torch.randint(0, 50, (1, 16))))
    probs = model.blocks[0].attn.probabilities(x)
    uniform = torch.tril(torch.ones(16, 16)) / torch.arange(1, 17).unsqueeze(1)
    assert torch.allclose(probs[0, 0], uniform, atol=1e-6)
    w = model.blocks[0].attn.projections()
    assert (w.w_q if zero == "query" else w.w_k).abs().sum() == 0


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(QkvlabError, match="needs a learned W_Q.*attn_zero_init = \"key\""):
        cfg(projection="q-identity", attn_zero_init="query")
    with pytest.raises(QkvlabError, match="parametrization='mu' is not one of standard, mup"):
        cfg(parametrization="mu")
    with pytest.raises(QkvlabError, match="depth_scaling='complete' is not one of"):
        cfg(depth_scaling="complete")
    with pytest.raises(QkvlabError, match="base_width must be a positive integer"):
        cfg(base_width=0)


def test_new_keys_at_their_defaults_leave_fingerprints_alone():
    identity = config_identity(RunConfig())
    for key in ("parametrization", "base_width", "base_depth", "depth_scaling",
                "attn_zero_init"):
        assert key not in identity["model"]
    mup = dataclasses.replace(RunConfig(), model=dataclasses.replace(
        RunConfig().model, parametrization="mup"))
    assert config_identity(mup)["model"]["parametrization"] == "mup"
