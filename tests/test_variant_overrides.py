"""A key the user sets for every variant (`qkvlab compare --set`, a spec's top-level `set`, a
sweep's `--set`) reaches every variant: a rule that would set it (the scale, the weight decay)
leaves it, a rule that derives a size derives it from the user's value, and a rule's
projection is refused in one line naming the variants (experiments/rules.py)."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from helpers import refused
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.experiments.compare import variant_configs
from qkvlab.experiments.rules import apply_rule, check_user_keys, user_keys
from qkvlab.experiments.spec import parse_spec
from qkvlab.model.scale import alpha_of
from qkvlab.model.variants import (
    COMPARE_RULES,
    REDUCED_WEIGHT_DECAY,
    TUNED_BASELINE_SCALE,
    TUNED_Q_IDENTITY_SCALE,
)
from qkvlab.run.config import load_config

BASE = "compare-quick"


def base_with(*overrides: str):
    return load_config(BASE, list(overrides)), user_keys(overrides)


def test_user_keys_are_section_dot_key():
    assert user_keys(["model.attn_scale=standard", "optim.lr=1e-3", "model.attn_scale=0.1"]) \
        == {"model.attn_scale", "optim.lr"}


def test_a_rule_keeps_the_users_scale_and_weight_decay():
    plain, none = base_with()
    assert apply_rule(plain, "q-identity", none).model.attn_scale == "paper"
    assert apply_rule(plain, "q-identity", none).optim.weight_decay == REDUCED_WEIGHT_DECAY
    base, user = base_with("model.attn_scale=standard", "optim.weight_decay=0.05")
    for rule in ("baseline", "q-identity", "q-identity-wide", "nonlinear-q", "smaller-mlp"):
        cfg = apply_rule(base, rule, user)
        assert cfg.model.attn_scale == "standard" and cfg.optim.weight_decay == 0.05, rule
    # the rule still does what it is for
    assert apply_rule(base, "q-identity", user).model.projection == "q-identity"


def test_the_key_and_value_rules_remove_their_projection_and_scale_as_the_result_says():
    import math

    plain, none = base_with()
    d_k = plain.model.d_head
    k, v = apply_rule(plain, "k-identity", none), apply_rule(plain, "v-identity", none)
    assert (k.model.projection, v.model.projection) == ("k-identity", "v-identity")
    assert k.model.scale == pytest.approx(0.5 / math.sqrt(d_k))  # logits as W_Q = I's: halved
    assert v.model.scale == pytest.approx(1 / math.sqrt(d_k))  # logits as the baseline's
    assert k.optim.weight_decay == v.optim.weight_decay == REDUCED_WEIGHT_DECAY


def test_sizes_are_derived_from_the_users_value():
    base, user = base_with("model.mlp_hidden=320", "model.n_embd=256")
    assert apply_rule(base, "q-identity-wide", user).model.mlp_hidden == 320 + 128
    assert apply_rule(base, "smaller-mlp", user).model.mlp_hidden == 320 - 128
    assert apply_rule(base, "narrower", user).model.n_embd == 256 - 2 * 4


def test_a_rules_projection_cannot_be_set_for_every_variant():
    user = user_keys(["model.projection=k-identity"])
    with pytest.raises(QkvlabError, match=r"model.projection .*rule of variant\(s\) q-id, "
                                          r"wide sets it .*: do this$"):
        check_user_keys({"base": "baseline", "q-id": "q-identity", "wide": "q-identity-wide"},
                        user, "do this")
    check_user_keys({"base": "baseline", "ctrl": "smaller-mlp"}, user, "fine")  # none sets it


def test_compare_configs_carry_the_users_keys(tmp_path):
    overrides = ["model.attn_scale=standard", "optim.weight_decay=0.07", "train.max_steps=3"]
    variants = variant_configs(load_config(BASE, overrides), overrides, tmp_path)
    assert [name for name, _, _ in variants] == list(COMPARE_RULES)
    for name, what, cfg in variants:
        assert cfg.model.attn_scale == "standard" and cfg.optim.weight_decay == 0.07
        assert cfg.run_dir == tmp_path / name and "weight decay 0.07" in what
    # without them: each arm at its tuned alpha / sqrt(d_k), the paper's recipe (halved) labelled
    plain = {n: (w, c) for n, w, c in variant_configs(load_config(BASE), [], tmp_path)}
    standard = 1 / math.sqrt(plain["baseline-tuned"][1].model.d_head)
    assert plain["q-identity"][1].model.scale == pytest.approx(standard / 2)
    assert "the paper's recipe" in plain["q-identity"][0]
    what, cfg = plain["baseline-tuned"]
    assert cfg.model.projection == "baseline" and cfg.optim.weight_decay == 0.1
    assert cfg.model.scale == pytest.approx(alpha_of(TUNED_BASELINE_SCALE) * standard)
    assert f"attn scale {cfg.model.scale:.4g} ({TUNED_BASELINE_SCALE}), weight decay 0.1" in what
    for name in ("q-identity-tuned", "q-identity-tuned-wide"):
        what, cfg = plain[name]
        assert cfg.model.scale == pytest.approx(alpha_of(TUNED_Q_IDENTITY_SCALE) * standard)
        assert cfg.model.projection == "q-identity"
        assert cfg.optim.weight_decay == REDUCED_WEIGHT_DECAY
        assert f"({TUNED_Q_IDENTITY_SCALE}), weight decay 0.03125" in what


def tiny_compare_args(data_dir: Path, out: Path, *more: str) -> list[str]:
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    sets = [f"data.dir={data_dir}", "data.prepare_if_missing=false", f"model.vocab_size={vocab}",
            "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "train.batch_size=4", "train.eval_interval=2", "train.eval_windows=4",
            "train.log_interval=1", "train.dtype=fp32", "train.device=cpu",
            "train.tensorboard=false", "train.peak_flops=1e12", *more]
    return ["compare", "--steps", "2", "--out", str(out), *[a for s in sets for a in ("--set", s)]]


def test_compare_cli_trains_every_variant_at_the_users_scale(data_dir, tmp_path):
    out = tmp_path / "cmp"
    assert main(tiny_compare_args(data_dir, out, "model.attn_scale=standard")) == 0
    for name in COMPARE_RULES:
        text = (out / name / "config.toml").read_text()
        model = tomllib.loads(text)["model"]
        assert model["attn_scale"] == "standard", name
        assert model["attn_impl"] in ("sdpa", "eager")  # the kernel it ran on, never "auto"
        assert "resolved: 0.25" in text  # 1/sqrt(d_k), d_k = 16
    rows = json.loads((out / "compare.json").read_text())
    assert {r["attn_scale"] for r in rows} == {0.25}


def test_compare_cli_refuses_a_projection_for_every_variant(data_dir, tmp_path, capsys):
    err = refused(capsys, tiny_compare_args(data_dir, tmp_path / "cmp",
                                            "model.projection=k-identity"))
    assert "model.projection" in err
    assert "q-identity-tuned, q-identity-tuned-wide, q-identity" in err
    assert not (tmp_path / "cmp").exists()  # refused before anything trained


SPEC = '''[spec]
name = "s"
base = "compare-quick"
set = ["model.attn_scale=standard", "optim.weight_decay=0.05"]
[[variant]]
name = "baseline"
baseline = true
rule = "baseline"
[[variant]]
name = "qid"
rule = "q-identity"
[[variant]]
name = "nlq"
rule = "nonlinear-q"
[[variant]]
name = "qid-own"
rule = "q-identity"
attn_scale = "matched"
set = ["optim.weight_decay=0.01"]
'''


def test_a_specs_set_reaches_every_variant_and_its_own_settings_win():
    groups = {g.name: g.config for g in parse_spec(tomllib.loads(SPEC), "t").groups()}
    for name in ("baseline", "qid", "nlq"):
        assert groups[name].model.attn_scale == "standard", name
        assert groups[name].optim.weight_decay == 0.05, name
    assert groups["qid"].model.projection == "q-identity"
    assert groups["qid-own"].model.attn_scale == "matched"  # the variant's field
    assert groups["qid-own"].optim.weight_decay == 0.01  # the variant's own set
    # the sweep's --set is the user's too
    again = parse_spec(tomllib.loads(SPEC), "t").groups(["model.attn_scale=0.3"])
    assert {g.name: g.config.model.attn_scale for g in again}["qid"] == 0.3


def test_a_specs_set_of_a_rules_projection_is_refused_naming_the_variants():
    text = SPEC.replace('set = ["model.attn_scale', 'set = ["model.projection=k-identity", '
                                                     '"model.attn_scale', 1)
    with pytest.raises(QkvlabError, match=r"spec s: model.projection .* qid, nlq, qid-own sets "
                                          r"it .*: set it in those variants' own `set`"):
        parse_spec(tomllib.loads(text), "t").groups()


def test_sweep_writes_the_specs_set_into_every_run_config(data_dir, tmp_path, capsys):
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC.replace(
        'set = [', f'set = ["data.dir={data_dir}", "data.prepare_if_missing=false", '
                   f'"model.vocab_size={vocab}", "model.n_layer=1", "model.n_embd=32", '
                   '"model.n_head=2", "model.block_size=16", ', 1), encoding="utf-8")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--print-commands"]) == 0
    scales = {p.parent.parent.name: tomllib.loads(p.read_text())["model"]
              for p in out.glob("*/seed-*/config.toml")}
    assert sorted(scales) == ["baseline", "nlq", "qid", "qid-own"]
    assert {n: m["attn_scale"] for n, m in scales.items()} == {
        "baseline": "standard", "nlq": "standard", "qid": "standard", "qid-own": "matched"}
    assert all(m["attn_impl"] in ("sdpa", "eager") for m in scales.values())
