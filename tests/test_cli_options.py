"""The pieces the verbs share: one `--set` grammar for `qkvlab train` and `qkvlab bench`, each
CLI default written once (in the verb's options dataclass), one validation guard, and the paired
t-test of `qkvlab report` against a textbook computation."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from pathlib import Path

import pytest

import qkvlab.commands
from qkvlab.bench.run import parse_overrides
from qkvlab.cli import build_parser, main, options_from
from qkvlab.commands.common import option_defaults
from qkvlab.commands.train import SampleOptions
from qkvlab.errors import QkvlabError
from qkvlab.experiments.stats import paired_t
from qkvlab.run.config import apply_overrides, parse_override


# ---- one --set grammar ---------------------------------------------------------------------
@pytest.mark.parametrize("value, want", [
    ("4", 4), ("1e-3", 1e-3), ("true", True), ('"a b"', "a b"), ("rmsnorm", "rmsnorm"),
    ("data/x y", "data/x y"), ("[1, 2]", [1, 2]),
])
def test_train_and_bench_read_a_value_alike(value, want):
    # a key the config does not know, so no field type changes the value (see below)
    assert parse_override(f"model.key={value}") == ("model", "key", want)
    assert parse_overrides([f"key={value}"]) == parse_overrides([f"model.key={value}"]) == {
        "key": want}


@pytest.mark.parametrize("value", ["[1", "'x", 'a"b', "{x", "a=b", "a#b"])
def test_train_and_bench_refuse_the_same_non_values(value):
    for parse in (lambda: parse_override(f"model.norm={value}"),
                  lambda: parse_overrides([f"norm={value}"])):
        with pytest.raises(QkvlabError, match="is not a TOML value"):
            parse()


def test_text_fields_keep_their_text_in_both():
    # TOML reads 2024 as a number; a text field takes the text as written
    assert apply_overrides({}, ["run.name=2024", "data.dir=1e3"]) == {
        "run": {"name": "2024"}, "data": {"dir": "1e3"}}
    assert parse_overrides(["norm=2024"]) == {"norm": "2024"}
    assert parse_overrides(["n_layer=2024"]) == {"n_layer": 2024}  # an int field keeps the int


@pytest.mark.parametrize("items, needle", [
    (["optim.lr=1"], "bench sets model keys only"),
    (["n_layer"], "is not key=value or model.key=value"),
    (["=4"], "is not key=value or model.key=value"),
    (["model.a.b=1"], "is not key=value or model.key=value"),
    (["projection=k-identity"], "chosen by --schemes"),
])
def test_bench_refusals(items, needle):
    with pytest.raises(QkvlabError, match=needle):
        parse_overrides(items)


def test_a_value_nested_too_deeply_is_a_user_error(capsys):
    item = "train.max_steps=" + "[" * 5000
    with pytest.raises(QkvlabError, match="nests too deeply"):
        parse_override(item)
    assert main(["params", "shakespeare-char", "--set", item]) == 2
    err = capsys.readouterr().err
    assert "nests too deeply" in err and "Traceback" not in err


# ---- each default written once -------------------------------------------------------------
def _verbs() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def test_every_option_is_a_field_and_every_field_an_option():
    for verb, parser in _verbs().items():
        options = parser.get_default("options")
        assert {a.dest for a in _arguments(parser)} == \
            {f.name for f in dataclasses.fields(options)}, verb


def test_cli_defaults_are_the_options_defaults():
    """Parsing only the required arguments gives the options dataclass's own defaults."""
    for verb, parser in _verbs().items():
        options = parser.get_default("options")
        required = [a for a in _arguments(parser) if not a.option_strings and a.nargs is None]
        given = {a.dest: f"{a.dest}-value" for a in required}
        parsed = options_from(parser.parse_args(list(given.values())))
        assert parsed == options(**given), verb
        for action in _arguments(parser):
            assert action.default == option_defaults(options).get(action.dest), (verb, action)


def test_no_add_argument_writes_a_default():
    """The options dataclass is the one place a default is written."""
    for path in sorted(Path(qkvlab.commands.__file__).parent.glob("*.py")):
        if path.name == "retrofit_demo.py":  # a plain argparse script, no options class
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                assert "default" not in {k.arg for k in node.keywords}, \
                    f"{path.name}:{node.lineno}"


def test_help_shows_a_default_from_the_options(capsys):
    assert main(["sweep", "--help"]) == 0
    assert "(default 1)" in " ".join(capsys.readouterr().out.split())


# ---- the guard ----------------------------------------------------------------------------
@pytest.mark.parametrize("change, needle", [
    (dict(max_new_tokens=-1), "--max-new-tokens must be >= 0, got -1"),
    (dict(num_samples=0), "--num-samples must be >= 1, got 0"),
    (dict(temperature=math.nan), "--temperature must be >= 0 (0 is greedy), got nan"),
    (dict(top_k=0), "--top-k must be >= 1, got 0"),
    (dict(top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
    (dict(stop_token=65), "--stop-token must be a token id in [0, 65), got 65"),
    (dict(seed=-1), "--seed must be in [0, 2**63), got -1"),
])
def test_sample_options_are_checked(change, needle):
    with pytest.raises(QkvlabError) as err:
        dataclasses.replace(SampleOptions(path="p"), **change).validate(65)
    assert str(err.value) == needle
    SampleOptions(path="p").validate(65)  # the defaults pass


# ---- the paired t-test --------------------------------------------------------------------
def test_paired_t_matches_the_textbook():
    """d = 1, 2, 3, 4: mean 2.5, s = sqrt(5/3), se = s / 2, t = 2.5 / se with 3 degrees of
    freedom; t_0.975(3) = 3.1824463052837 and the two-sided p from the t table."""
    test = paired_t([1.0, 2.0, 3.0, 4.0])
    se = math.sqrt(5 / 3) / 2
    assert (test.n, test.df, test.mean) == (4, 3, 2.5)
    assert test.std == pytest.approx(math.sqrt(5 / 3), rel=1e-12)
    assert test.se == pytest.approx(se, rel=1e-12)
    assert test.t == pytest.approx(2.5 / se, rel=1e-12)
    assert test.p == pytest.approx(0.0304665, rel=1e-5)
    half = 3.1824463052837 * se
    assert (test.ci_low, test.ci_high) == pytest.approx((2.5 - half, 2.5 + half), rel=1e-12)
    assert test.significant


def test_paired_t_edge_cases():
    one = paired_t([0.3])
    assert (one.n, one.mean, one.t, one.p, one.ci_low) == (1, 0.3, None, None, None)
    same = paired_t([0.2, 0.2, 0.2])  # no spread: an exact difference, not a huge t
    assert (same.t, same.p, same.ci_low, same.ci_high) == (math.inf, 0.0, 0.2, 0.2)
    zero = paired_t([0.0, 0.0])
    assert (zero.t, zero.p, zero.significant) == (0.0, 1.0, False)
