"""The attention scale rules (model.attn_scale): numbers, "paper", "standard", "matched" and the
learned per-head scale; what they resolve to, what they do at initialisation, how they are
recorded and where they are refused."""

from __future__ import annotations

import math

import pytest
import torch

from qkvlab.errors import QkvlabError
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.model.params import count_params
from qkvlab.run.config import config_toml, load_config, saved_config
from qkvlab.theory import convert
from qkvlab.theory.scale import initial_logit_std


def cfg(d: int = 64, **kw) -> ModelConfig:
    base = dict(n_layer=1, n_head=max(1, d // 64), n_embd=d, block_size=128, vocab_size=256)
    return ModelConfig(**{**base, **kw})


def test_rules_resolve_to_the_documented_numbers():
    dk = 64
    standard = 1 / math.sqrt(dk)
    assert cfg(256, projection="q-identity").scale == standard  # the default: as the baseline
    assert cfg(256, projection="q-identity", attn_scale="paper").scale == \
        pytest.approx(standard / 2)
    assert cfg(256, projection="q-identity", attn_scale="standard").scale == standard
    matched = cfg(256, projection="q-identity", attn_scale="matched").scale
    assert matched == pytest.approx(standard * 0.02 * math.sqrt(256))
    assert cfg(256, projection="k-identity", attn_scale="learned").scale == matched
    for rule in ("paper", "matched", "learned"):  # no identity query or key: standard
        assert cfg(256, attn_scale=rule).scale == standard
        assert cfg(256, projection="v-identity", attn_scale=rule).scale == standard
    assert cfg(256, attn_scale=0.3).scale == 0.3


@pytest.mark.parametrize("d", [128, 256, 768])
def test_matched_gives_the_baselines_initial_logit_std(d):
    base = initial_logit_std(cfg(d), seed=0)
    matched = initial_logit_std(cfg(d, projection="q-identity", attn_scale="matched"), seed=0)
    paper = initial_logit_std(cfg(d, projection="q-identity", attn_scale="paper"), seed=0)
    # ~65k logits per model: the std's sampling error is well under 1%; 3% leaves room for
    # the weights' own draw
    assert matched / base == pytest.approx(1.0, abs=0.03)
    # the paper's halving is calibrated at d = 768 only: at 0.90 there, 1.56 at 256, 2.2 at 128
    expected_paper = 0.5 / (0.02 * math.sqrt(d))
    assert paper / base == pytest.approx(expected_paper, rel=0.05)


def test_learned_scale_starts_at_matched_and_learns():
    torch.manual_seed(0)
    learned = GPT(cfg(128, n_layer=2, projection="q-identity", attn_scale="learned"))
    torch.manual_seed(0)
    matched = GPT(cfg(128, n_layer=2, projection="q-identity", attn_scale="matched"))
    idx = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(learned(idx)[0], matched(idx)[0], rtol=0, atol=0)
    gains = [b.attn.logit_gain for b in learned.blocks]
    assert all(g.shape == (2,) and bool((g == 1).all()) for g in gains)
    learned(idx, idx)[1].backward()
    assert all(g.grad is not None and float(g.grad.abs().sum()) > 0 for g in gains)
    counted = count_params(learned.cfg)
    assert counted.logit_gain == 2 * 2
    assert counted.total == sum(p.numel() for p in learned.parameters())
    assert counted.total == count_params(matched.cfg).total + 4


def test_learned_gain_changes_only_its_head():
    torch.manual_seed(0)
    model = GPT(cfg(128, projection="q-identity", attn_scale="learned")).eval()
    x = torch.randn(1, 8, 128)
    q0, k0, _ = model.blocks[0].attn.heads(x)
    with torch.no_grad():
        model.blocks[0].attn.logit_gain[1] = 3.0
    q1, k1, _ = model.blocks[0].attn.heads(x)
    torch.testing.assert_close(q1[:, 0], q0[:, 0])
    torch.testing.assert_close(q1[:, 1], 3.0 * q0[:, 1])
    torch.testing.assert_close(k1, k0)


def test_resolved_config_records_rule_and_number():
    # the preset: d = 384, d_k = 64, init_std 0.02
    for rule, number in (("matched", 0.02 * math.sqrt(384) / 8), ("paper", 1 / 16)):
        run = load_config("shakespeare-char-qidentity", [f"model.attn_scale={rule}"])
        text = config_toml(run)
        line = next(l for l in text.splitlines() if l.startswith("attn_scale"))
        assert f'"{rule}"' in line and f"{number:.6g}" in line
    numeric = load_config("shakespeare-char", ["model.attn_scale=0.05"])
    assert numeric.model.attn_scale == 0.05 and "attn_scale = 0.05\n" in config_toml(numeric)


def test_old_configs_without_a_rule_mean_paper():
    # runs saved before the rule names wrote attn_scale as null or left it out: read on load
    for table in ({"attn_scale": None}, {}):
        assert saved_config({"model": table}).model.attn_scale == "paper"
    with pytest.raises(QkvlabError, match="attn_scale"):  # a live config names its rule
        ModelConfig(attn_scale=None)


@pytest.mark.parametrize("value", ["bogus", 0, -1.0, True, float("nan")])
def test_bad_scales_are_refused_with_the_choices(value):
    with pytest.raises(QkvlabError, match="attn_scale"):
        ModelConfig(attn_scale=value)


def test_theory_conversion_refuses_a_learned_scale():
    model = GPT(cfg(64, n_layer=1, attn_scale="learned"))
    with pytest.raises(QkvlabError, match="learned"):
        convert(model, "q-identity")


def test_attention_stats_measure_logit_spread_and_entropy():
    from qkvlab.theory.scale import attention_stats, uniform_entropy

    torch.manual_seed(0)
    idx = torch.randint(256, (2, 32))
    fresh = GPT(cfg(64, n_layer=2, block_size=32))
    stats = attention_stats(fresh, idx)
    assert len(stats) == 2 and fresh.training  # train mode restored, one row per layer
    # tiny initial logits: attention is nearly uniform over what each query may see
    assert stats[0]["entropy"] == pytest.approx(uniform_entropy(32), rel=1e-3)
    # layer 1's logit std, by hand: the first block's q k^T * scale over the causal pairs
    with torch.no_grad():
        x = fresh.wte(idx) + fresh.wpe(torch.arange(32))
        q, k, _ = fresh.blocks[0].attn.heads(fresh.blocks[0].norm1(x))
    logits = q @ k.transpose(-2, -1) * fresh.cfg.scale
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    assert stats[0]["logit_std"] == pytest.approx(float(logits[..., causal].std()), rel=1e-5)
    # the same weights at a 100x larger scale attend more sharply
    sharp = GPT(cfg(64, n_layer=2, block_size=32, attn_scale=100 * fresh.cfg.scale))
    sharp.load_state_dict(fresh.state_dict())
    hot = attention_stats(sharp, idx)
    assert hot[0]["logit_std"] == pytest.approx(100 * stats[0]["logit_std"], rel=1e-4)
    assert hot[0]["entropy"] < stats[0]["entropy"] - 0.5
    assert uniform_entropy(4) == pytest.approx((math.log(2) + math.log(3) + math.log(4)) / 4)
    with pytest.raises(ValueError, match="float32"):
        attention_stats(fresh.to(torch.bfloat16), idx)
