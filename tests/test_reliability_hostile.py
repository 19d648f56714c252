"""Hostile and malformed input thrown at the command line, in-process (`qkvlab.cli.main`).

Hypothesis generates configs, data folders, checkpoint folders and argument lists that are
malformed *by construction* (every example carries at least one defect that must be refused),
and each is run through the real CLI entry point. Every one must give

* exit code 2,
* exactly one line on stderr, `qkvlab COMMAND: error: ...`, and no traceback,
* not one file or folder created, changed or removed (a sha256 snapshot of every file and
  folder involved, including the shared template run and data, is equal before and after).

Pickle payloads whose unpickling would create a marker file are planted as checkpoint files
in every place a loader might look; they are refused and the marker never appears. A source
scan checks that nothing in the package can unpickle, eval or exec.

The number of generated inputs per category is printed at the end of the module (`-s`).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from helpers import tiny_overrides
from qkvlab.cli import build_parser, main
from qkvlab.data.prepare import prepare
from qkvlab.fsutil import sha256_file
from qkvlab.model.config import ModelConfig
from qkvlab.run import checkpoint as ck
from qkvlab.run import layout
from qkvlab.run.config import DataConfig, OptimConfig, TrainConfig, load_config, save_config
from qkvlab.train.trainer import train

SRC = Path(__file__).resolve().parents[1] / "src"
WORDS = ("the king is dead long live the queen my lord what say you to this fair maid "
         "hark who goes there and wherefore art thou so sad good night sweet prince").split()
COUNTS: collections.Counter[str] = collections.Counter()
REASONS: collections.Counter[str] = collections.Counter()  # the kinds of refusal seen
FUZZ = settings(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@pytest.fixture(autouse=True, scope="module")
def report_counts():
    yield
    total = sum(COUNTS.values())
    print(f"\nmalformed inputs tried: {total} " + json.dumps(dict(sorted(COUNTS.items()))))
    print(f"{len(REASONS)} distinct refusals; the most common:")
    for reason, n in REASONS.most_common(25):
        print(f"  {n:4d}  {reason}")


# ---- the world the hostile inputs are derived from ----------------------------------------
@dataclass
class World:
    root: Path
    data: Path  # a valid prepared data folder
    run: Path  # a valid run: ckpt-0000001, ckpt-0000002 (latest), best/
    other: Path  # a checkpoint of a different model (n_embd 48)
    base: dict[str, Any]  # the run's config as a TOML dict (no out_dir)
    vocab: int


def bare_overrides(data_dir: Path, vocab: int) -> list[str]:
    # no norm, skips around attention only: the model converts exactly, so `convert` refuses
    # the hostile input, not the theory
    # (data_dir may hold a broken dataset: the vocabulary is passed, not read from it)
    return tiny_overrides(
        data_dir, "model.norm=none", "model.residual=attention", "model.dropout=0.2",
        "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=1", "train.max_steps=2",
        "train.batch_size=2", "train.eval_interval=2", "train.eval_windows=4",
        "train.log_interval=10", "train.ckpt_interval=1", "train.compile=false", vocab=vocab)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("hostile")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
             for _ in range(120)]
    (root / "verse.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = root / "data"
    prepare(str(root / "verse.txt"), "char", data, val_fraction=0.1)
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    cfg = load_config("shakespeare-char", [*bare_overrides(data, vocab),
                                           f"run.out_dir={root / 'run'}"])
    train(cfg, quiet=True)
    other = load_config("shakespeare-char", [*bare_overrides(data, vocab), "model.n_embd=48",
                                             "train.max_steps=1", f"run.out_dir={root / 'o'}"])
    train(other, quiet=True)
    base = {s: {k: v for k, v in t.items() if v is not None} for s, t in cfg.to_dict().items()}
    base["run"].pop("out_dir", None)
    return World(root, data, root / "run", root / "o" / "ckpt-0000001", base, vocab)


# ---- running the CLI and checking the promise ---------------------------------------------
def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file and the name of every folder under the roots (or of a root file)."""
    out: dict[str, str] = {}
    for root in roots:
        if root.is_file():
            out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for p in root.rglob("*"):
            out[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def refused(argv: list[str], cwd: Path, watch: list[Path], category: str) -> str:
    """Run `qkvlab argv` in cwd; assert exit 2, one error line, no traceback, nothing written."""
    COUNTS[category] += 1
    before = snapshot(cwd, *watch)
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)  # anything but QkvlabError/usage errors propagates: a traceback
    finally:
        os.chdir(old)
    text = err.getvalue().strip()
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    prefix = f"qkvlab {command}: error: " if command in COMMANDS else "qkvlab: error: "
    assert rc == 2, (argv, rc, out.getvalue()[-500:], text)
    assert len(text.splitlines()) == 1, (argv, text)
    assert text.startswith(prefix), (argv, text)
    assert "Traceback" not in text + out.getvalue()
    assert snapshot(cwd, *watch) == before, argv
    reason = re.sub(r"(/[^\s:;,()]+)+", "PATH", text.split("error: ", 1)[1])
    REASONS[re.sub(r"-?\d[\d.e+-]*", "N", reason)[:70]] += 1
    return text


COMMANDS = {a for act in build_parser()._subparsers._group_actions for a in act.choices}


def workdir(world: World) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(dir=world.root, prefix="ex-")


# ---- malformed configs --------------------------------------------------------------------
SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                   "train": TrainConfig}
FIELD_TYPES: dict[tuple[str, str], str] = {
    (section, f.name): str(f.type).replace(" ", "")
    for section, cls in SECTION_CLASSES.items() for f in fields(cls)}
FIELD_TYPES.update({("run", "name"): "str", ("run", "out_dir"): "str|None"})
POSITIVE_INTS = [("model", k) for k in ("n_layer", "n_head", "n_embd", "block_size",
                                        "vocab_size", "n_kv_head", "head_dim", "mlp_hidden")] + \
    [("train", k) for k in ("max_steps", "batch_size", "grad_accum", "eval_interval",
                            "eval_windows", "eval_batch_size", "log_interval", "ckpt_interval",
                            "keep_last", "max_nonfinite")] + [("optim", "decay_steps")]
NON_NEGATIVE_INTS = [("optim", "warmup_steps"), ("train", "seed")]
# (section, key) -> values outside the allowed range, whatever the other keys say
BAD_FLOATS: dict[tuple[str, str], st.SearchStrategy] = {
    ("optim", "lr"): st.floats(max_value=0.0),
    ("optim", "min_lr"): st.floats(max_value=-1e-12),
    ("optim", "weight_decay"): st.floats(max_value=-1e-12),
    ("optim", "beta1"): st.one_of(st.floats(max_value=-1e-12), st.floats(min_value=1.0)),
    ("optim", "beta2"): st.one_of(st.floats(max_value=-1e-12), st.floats(min_value=1.0)),
    ("optim", "eps"): st.floats(max_value=0.0),
    ("optim", "grad_clip"): st.floats(max_value=-1e-12),
    ("model", "dropout"): st.one_of(st.floats(max_value=-1e-12), st.floats(min_value=1.0)),
    ("model", "mlp_ratio"): st.one_of(st.floats(max_value=0.0), st.floats(min_value=64.001)),
    ("model", "init_std"): st.floats(max_value=0.0),
    ("model", "rope_base"): st.floats(max_value=1.0),
    ("model", "attn_scale"): st.floats(max_value=0.0),
    ("train", "peak_flops"): st.floats(max_value=0.0),
}
ENUMS = [("model", k) for k in ("activation", "norm", "positions", "residual", "projection")] \
    + [("train", k) for k in ("dtype", "device", "parallel", "objective")] \
    + [("data", "tokenizer")]  # any other tokenizer than the data's is refused at training
EMPTY_STRINGS = [("data", "dir"), ("data", "source"), ("data", "tokenizer"), ("run", "name")]

scalars = st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=12),
                    st.datetimes(min_value=datetime.datetime(1, 1, 1)))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                      st.dictionaries(st.text(max_size=5), kids,
                                                                      max_size=3)),
                      max_leaves=6)


def wrong_type_values(type_str: str) -> st.SearchStrategy:
    """Values a field of this annotation must refuse (TOML cannot write None)."""
    base = type_str.removesuffix("|None")
    containers = st.one_of(st.lists(scalars, max_size=3),
                           st.dictionaries(st.text(max_size=5), scalars, max_size=2),
                           st.datetimes(min_value=datetime.datetime(1, 1, 1)))
    if base == "int":
        return st.one_of(st.floats(), st.booleans(), st.text(max_size=8), containers)
    if base == "float":
        return st.one_of(st.booleans(), st.text(max_size=8), containers)
    if base == "bool":
        return st.one_of(st.integers(), st.floats(), st.text(max_size=8), containers)
    return st.one_of(st.integers(), st.floats(), st.booleans(), containers)  # str


def known(section: str, key: str) -> bool:
    return (section, key) in FIELD_TYPES


@st.composite
def config_defect(draw, for_override: bool = False) -> list[tuple[str, str, Any]]:
    """One defect as (section, key, value) assignments; key "" replaces the whole section."""
    kinds = ["unknown_key", "unknown_section", "wrong_type", "negative", "bad_float",
             "nonfinite", "enum", "empty", "absurd_size", "absurd_memory", "not_a_table",
             "nul", "beyond_64_bits"]
    if for_override:  # --set takes one scalar per key; text fields keep any text
        kinds = [k for k in kinds if k not in ("unknown_section", "not_a_table", "nul")]
    kind = draw(st.sampled_from(kinds))
    ident = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
    if kind == "unknown_key":
        section = draw(st.sampled_from(["run", "model", "data", "optim", "train"]))
        key = draw(ident.filter(lambda k, s=section: not known(s, k)))
        return [(section, key, draw(values if not for_override else scalars))]
    if kind == "unknown_section":
        name = draw(ident.filter(lambda k: k not in ("run", "model", "data", "optim", "train")))
        return [(name, "", draw(st.dictionaries(ident, scalars, max_size=3)))]
    if kind == "wrong_type":
        pairs = sorted(p for p, t in FIELD_TYPES.items()
                       if not (for_override and t.startswith("str")))
        section, key = draw(st.sampled_from(pairs))
        return [(section, key, draw(wrong_type_values(FIELD_TYPES[(section, key)])))]
    if kind == "negative":
        section, key = draw(st.sampled_from([p for p in POSITIVE_INTS + NON_NEGATIVE_INTS
                                             if known(*p)]))
        top = 0 if (section, key) in POSITIVE_INTS else -1
        return [(section, key, draw(st.integers(min_value=-(1 << 63), max_value=top)))]
    if kind == "bad_float":
        section, key = draw(st.sampled_from(sorted(BAD_FLOATS)))
        value = draw(BAD_FLOATS[(section, key)].filter(lambda v: v == v))
        return [(section, key, value)]
    if kind == "nonfinite":
        section, key = draw(st.sampled_from(sorted(p for p, t in FIELD_TYPES.items()
                                                   if t.startswith("float"))))
        return [(section, key, draw(st.sampled_from([float("nan"), float("inf"),
                                                     float("-inf")])))]
    if kind == "enum":
        section, key = draw(st.sampled_from([p for p in ENUMS if known(*p)]))
        return [(section, key, "zz-" + draw(st.text(max_size=8)))]
    if kind == "empty":
        section, key = draw(st.sampled_from(EMPTY_STRINGS))
        if for_override and key == "name":
            key = "dir"  # --set run.name=" " would be stripped to "" by the shell anyway
        return [(section, key, draw(st.sampled_from(["", " ", "\t"])) if key == "name" else "")]
    if kind == "absurd_size":  # beyond what the model config accepts at all
        key, low = draw(st.sampled_from([("n_layer", 1025), ("n_embd", 65537),
                                         ("block_size", (1 << 20) + 1),
                                         ("vocab_size", (1 << 24) + 1)]))
        return [("model", key, draw(st.integers(min_value=low, max_value=(1 << 63) - 1)))]
    if kind == "absurd_memory":  # accepted sizes that no machine can hold
        choice = draw(st.sampled_from(["model", "batch", "windows"]))
        if choice == "model":
            return [("model", "n_head", 1),
                    ("model", "n_layer", draw(st.integers(500, 1024))),
                    ("model", "n_embd", draw(st.integers(40_000, 65_536)))]
        key = "batch_size" if choice == "batch" else "eval_windows"
        return [("train", key, draw(st.integers(min_value=10**11, max_value=(1 << 63) - 1)))]
    if kind == "beyond_64_bits":  # TOML ints are 64-bit; tomllib reads bigger ones anyway
        section, key = draw(st.sampled_from(sorted(p for p, t in FIELD_TYPES.items()
                                                   if t.startswith("int"))))
        big = draw(st.integers(min_value=1 << 63, max_value=1 << 200))
        return [(section, key, big * draw(st.sampled_from([1, -1])))]
    if kind == "not_a_table":
        section = draw(st.sampled_from(["run", "model", "data", "optim", "train"]))
        return [(section, "", draw(scalars))]
    # "nul": a NUL character in a text field
    section, key = draw(st.sampled_from([("data", "dir"), ("data", "tokenizer"),
                                         ("model", "projection"), ("run", "name")]))
    return [(section, key, draw(st.text(max_size=4)) + "\0" + draw(st.text(max_size=4)))]


def apply_defects(base: dict[str, Any], defects: list[list[tuple[str, str, Any]]]) -> dict:
    data = {s: dict(t) for s, t in base.items()}
    for defect in defects:
        for section, key, value in defect:
            if key == "":
                data[section] = value
            else:
                if not isinstance(data.get(section), dict):
                    data[section] = {}
                data[section][key] = value
    return data


def toml_literal(value: Any) -> str:
    return tomli_w.dumps({"v": value}).partition("=")[2].strip()


@pytest.mark.slow
@settings(FUZZ, max_examples=200)
@given(defects=st.lists(config_defect(), min_size=1, max_size=3))
def test_malformed_config_files(world, defects):
    with workdir(world) as d:
        d = Path(d)
        cfg = d / "bad.toml"
        cfg.write_text(tomli_w.dumps(apply_defects(world.base, defects)), encoding="utf-8")
        refused(["train", str(cfg), "--out", str(d / "run")], d, [world.data], "config file")


@pytest.mark.slow
@settings(FUZZ, max_examples=80)
@given(defects=st.lists(config_defect(for_override=True), min_size=1, max_size=2))
def test_malformed_set_overrides(world, defects):
    with workdir(world) as d:
        d = Path(d)
        cfg = save_config(load_config("shakespeare-char", bare_overrides(world.data,
                                                                          world.vocab)),
                          d / "good.toml")
        argv = ["train", str(cfg), "--out", str(d / "run")]
        for defect in defects:
            for section, key, value in defect:
                argv += ["--set", f"{section}.{key}={toml_literal(value)}"]
        refused(argv, d, [world.data], "config --set")


@settings(FUZZ, max_examples=60)
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(
    lambda b: b.decode("latin-1"))), raw=st.booleans(), depth=st.integers(0, 3000))
def test_config_files_that_are_not_toml(world, text, raw, depth):
    with workdir(world) as d:
        d = Path(d)
        cfg = d / "junk.toml"
        if depth > 2000:  # nested thousands deep: the parser's recursion, not a crash
            cfg.write_text("[train]\nmax_steps = " + "[" * depth + "]" * depth + "\n")
        elif raw:
            cfg.write_bytes(b"\xff\xfe\x00" + text.encode("utf-8", "surrogatepass"))
        else:
            try:
                parsed = __import__("tomllib").loads(text)
            except Exception:  # noqa: BLE001 - any parse failure is what we want here
                parsed = None
            assume(parsed is None or set(parsed) - {"run", "model", "data", "optim", "train"})
            cfg.write_text(text, encoding="utf-8", errors="surrogatepass")
        refused(["train", str(cfg), "--out", str(d / "run")], d, [world.data], "config junk")


# ---- malformed data folders ---------------------------------------------------------------
@st.composite
def data_defect(draw) -> tuple[str, Any]:
    kinds = ["meta_junk", "meta_field", "meta_missing", "truncate", "extend", "delete_bin",
             "ids_beyond_vocab", "wrong_dtype", "empty", "too_short", "tokenizer_files",
             "no_meta", "vocab_below_ids"]
    kind = draw(st.sampled_from(kinds))
    if kind == "meta_junk":
        return kind, draw(st.one_of(st.binary(max_size=64), st.just(b""),
                                    values.map(lambda v: json.dumps(v, default=str).encode())))
    if kind == "meta_field":
        key = draw(st.sampled_from(["format", "tokenizer", "vocab_size", "dtype",
                                    "train_tokens", "val_tokens", "eot_token"]))
        bad = {"format": st.one_of(st.integers().filter(lambda v: v != 1), st.text(max_size=4)),
               "tokenizer": st.one_of(st.integers(), st.sampled_from(["bytes", "gpt2", "bpe:300",
                                                                     "nope"])),
               "vocab_size": st.one_of(st.integers(max_value=0), st.integers(min_value=2**32 + 1),
                                       st.floats(), st.text(max_size=4), st.booleans()),
               "dtype": st.one_of(st.sampled_from(["uint8", "int64", "float32", "uint32"]),
                                  st.lists(st.integers(), max_size=2), st.integers()),
               "train_tokens": st.one_of(st.integers(max_value=-1), st.text(max_size=4),
                                         st.floats()),
               "val_tokens": st.one_of(st.integers(max_value=-1), st.text(max_size=4),
                                       st.floats(), st.booleans()),
               "eot_token": st.one_of(st.integers(max_value=-1), st.text(max_size=3),
                                      st.floats())}[key]
        return kind, (key, draw(bad))
    if kind == "meta_missing":
        return kind, draw(st.sampled_from(["format", "tokenizer", "vocab_size", "dtype",
                                           "train_tokens", "val_tokens"]))
    if kind in ("truncate", "extend"):
        return kind, (draw(st.sampled_from(["train", "val"])), draw(st.integers(1, 64)))
    if kind in ("delete_bin", "empty"):
        return kind, draw(st.sampled_from(["train", "val"]))
    if kind == "ids_beyond_vocab":
        return kind, (draw(st.sampled_from(["train", "val"])), draw(st.integers(0, 10**6)),
                      draw(st.integers(0, 65535 - 200)))
    if kind == "too_short":
        return kind, (draw(st.sampled_from(["train", "val"])), draw(st.integers(0, 16)))
    if kind == "tokenizer_files":
        return kind, draw(st.sampled_from([["../../escape.json"], ["/etc/passwd"], [".."],
                                           ["a/b.json"], "char_vocab.json", [3], [""]]))
    if kind == "vocab_below_ids":
        return kind, draw(st.integers(1, 30))
    return kind, None  # wrong_dtype, no_meta


def make_bad_data(src: Path, dest: Path, defects: list[tuple[str, Any]]) -> None:
    shutil.copytree(src, dest)
    meta = json.loads((dest / "meta.json").read_text())
    meta_bytes: bytes | None = None
    no_meta = False
    for kind, arg in defects:
        split = arg[0] if isinstance(arg, tuple) else arg
        if kind in ("truncate", "extend", "ids_beyond_vocab", "too_short") \
                and not (dest / f"{split}.bin").exists():
            continue  # deleted by an earlier defect, which is defect enough
        if kind == "meta_junk":
            meta_bytes = arg
        elif kind == "meta_field":
            meta[arg[0]] = arg[1]
        elif kind == "meta_missing":
            meta.pop(arg, None)
        elif kind == "truncate":
            path = dest / f"{arg[0]}.bin"
            path.write_bytes(path.read_bytes()[: max(0, path.stat().st_size - arg[1])])
        elif kind == "extend":
            path = dest / f"{arg[0]}.bin"
            path.write_bytes(path.read_bytes() + b"\x01" * arg[1])
        elif kind == "delete_bin":
            (dest / f"{arg}.bin").unlink(missing_ok=True)
        elif kind == "empty":
            (dest / f"{arg}.bin").write_bytes(b"")
            meta[f"{arg}_tokens"] = 0
        elif kind == "ids_beyond_vocab":
            path = dest / f"{arg[0]}.bin"
            ids = np.fromfile(path, dtype="<u2")
            if ids.size:
                ids[arg[1] % ids.size] = 200 + arg[2]  # far above the ~40 char ids
                ids.tofile(path)
        elif kind == "wrong_dtype":  # the tokens rewritten as uint32, meta.json unchanged
            for name in ("train", "val"):
                path = dest / f"{name}.bin"
                if path.exists():
                    np.fromfile(path, dtype="<u2").astype("<u4").tofile(path)
        elif kind == "too_short":
            path = dest / f"{arg[0]}.bin"
            path.write_bytes(path.read_bytes()[: 2 * arg[1]])
            meta[f"{arg[0]}_tokens"] = arg[1]
        elif kind == "tokenizer_files":
            meta["tokenizer_files"] = arg
        elif kind == "vocab_below_ids":
            meta["vocab_size"] = arg  # the ids go up to ~40
        elif kind == "no_meta":
            no_meta = True
    if no_meta:
        (dest / "meta.json").unlink()
    elif meta_bytes is not None:
        (dest / "meta.json").write_bytes(meta_bytes)
    else:
        (dest / "meta.json").write_text(json.dumps(meta))


def _to_val(arg: Any) -> Any:
    return ("val", *arg[1:]) if isinstance(arg, tuple) else "val"


@pytest.mark.slow
@settings(FUZZ, max_examples=160)
@given(defects=st.lists(data_defect(), min_size=1, max_size=3), via_eval=st.booleans())
def test_malformed_data_folders(world, defects, via_eval):
    with workdir(world) as d:
        d = Path(d)
        bad = d / "data"
        make_bad_data(world.data, bad, defects)
        if via_eval:
            # eval reads only the val split's windows: a train split that is merely short or
            # empty is fine for it (every other defect breaks the folder as a whole), so
            # shorten the val split instead
            defects = [(k, _to_val(a)) if k in ("too_short", "empty") else (k, a)
                       for k, a in defects]
            shutil.rmtree(bad)
            make_bad_data(world.data, bad, defects)
            refused(["eval", str(world.run), "--data", str(bad)], d, [world.run, world.data],
                    "data folder")
        else:
            cfg = save_config(load_config("shakespeare-char", [
                *bare_overrides(bad, world.vocab)]), d / "c.toml")
            refused(["train", str(cfg), "--out", str(d / "run")], d, [world.data],
                    "data folder")


# ---- malformed checkpoints ----------------------------------------------------------------
def reseal(ckpt: Path) -> None:
    """Rewrite the manifest to match the files as they are now (a "consistent" forgery)."""
    manifest = json.loads((ckpt / layout.MANIFEST_FILE).read_text())
    for name in list(manifest["files"]):
        if (ckpt / name).is_file():
            manifest["files"][name] = {"size": (ckpt / name).stat().st_size,
                                       "sha256": sha256_file(ckpt / name)}
    (ckpt / layout.MANIFEST_FILE).write_text(json.dumps(manifest))


def edit_state(ckpt: Path, fn) -> None:
    state = json.loads((ckpt / layout.STATE_FILE).read_text())
    out = fn(state)
    (ckpt / layout.STATE_FILE).write_text(json.dumps(state if out is None else out, default=str))


FILES = [layout.MODEL_FILE, layout.OPTIM_FILE, layout.STATE_FILE]
# config keys `sample` rightly does not look at (it needs neither data nor a batch size)
SAMPLE_IGNORES = {("train", "batch_size"), ("train", "eval_windows"), ("data", "tokenizer")}
SEALED = {"model_bytes", "model_other", "model_keys", "model_dtype", "model_nan", "state_junk",
          "state_field", "state_config", "state_other_config", "rng", "opt_bytes", "opt_shape",
          "opt_key", "opt_dtype", "opt_meta", "opt_none"}


@st.composite
def ckpt_defect(draw, optimizer_only: bool = False):
    """(kind, arg). Unsealed damage breaks the manifest; sealed forgeries pass it and must be
    caught by the loaders themselves."""
    if optimizer_only:
        kind = draw(st.sampled_from(["opt_bytes", "opt_shape", "opt_key", "opt_dtype",
                                     "opt_meta", "opt_none"]))
    else:
        kind = draw(st.sampled_from(["truncate", "flip", "append", "delete", "replace",
                                     "manifest_junk", "manifest_entry", "model_bytes",
                                     "model_other", "model_keys", "model_dtype", "model_nan",
                                     "state_junk", "state_field", "state_config",
                                     "state_other_config", "rng"]))
    file = draw(st.sampled_from(FILES))
    if kind in ("truncate", "append"):
        return kind, (file, draw(st.integers(1, 4096)))
    if kind == "flip":
        return kind, (file, draw(st.integers(0, 10**7)), draw(st.integers(1, 255)))
    if kind == "delete":
        return kind, draw(st.sampled_from([*FILES, layout.MANIFEST_FILE]))
    if kind == "replace":
        return kind, (file, draw(st.binary(max_size=300)))
    if kind == "manifest_junk":
        return kind, draw(st.one_of(st.binary(max_size=100),
                                    values.map(lambda v: json.dumps(v, default=str).encode())))
    if kind == "manifest_entry":
        how = draw(st.sampled_from(["drop", "size", "sha", "badname", "phantom", "entry"]))
        return kind, (how, draw(st.sampled_from(FILES)), draw(values))
    if kind in ("model_bytes", "opt_bytes"):
        return kind, draw(st.one_of(st.binary(max_size=300), st.just(b""),
                                    st.just(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
                                    st.just(b"\xff" * 8 + b"{}")))
    if kind == "model_keys":
        return kind, draw(st.sampled_from(["drop", "add", "rename"]))
    if kind in ("model_dtype", "opt_dtype"):
        return kind, draw(st.sampled_from([torch.int32, torch.int64, torch.bool, torch.uint8]))
    if kind == "model_nan":
        return kind, draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    if kind == "state_junk":
        return kind, draw(st.one_of(st.binary(max_size=80),
                                    values.map(lambda v: json.dumps(v, default=str).encode())))
    if kind == "state_field":
        key = draw(st.sampled_from(["format", "format_version", "step", "best_val_loss",
                                    "val_loss", "skipped_steps", "world_size", "config",
                                    "optimizer"]))
        bad = {"format": st.text(max_size=5), "format_version": st.one_of(
            st.integers(min_value=2), st.text(max_size=3), st.floats(), st.lists(scalars)),
            "step": st.one_of(st.integers(max_value=-1), st.integers(min_value=3),
                              st.floats(), st.text(max_size=3), st.booleans()),
            "best_val_loss": st.one_of(st.text(max_size=3), st.booleans(), st.lists(scalars)),
            "val_loss": st.one_of(st.text(max_size=3), st.booleans(), st.lists(scalars)),
            "skipped_steps": st.one_of(st.integers(max_value=-1), st.text(max_size=3)),
            "world_size": st.one_of(st.integers(max_value=-1), st.floats()),
            "config": st.one_of(scalars, st.lists(scalars)),
            "optimizer": st.one_of(scalars.filter(lambda v: v is not None),
                                   st.lists(scalars))}[key]
        return kind, (key, draw(bad))
    if kind == "state_config":
        # a defect that is wrong for every command (no batch/eval-window sizes: eval and
        # sample would rightly not care)
        defects = draw(st.lists(config_defect(), min_size=1, max_size=2).filter(
            lambda ds: all((s, k) not in SAMPLE_IGNORES for dd in ds for s, k, _ in dd)))
        return kind, defects
    if kind == "rng":
        return kind, draw(st.one_of(
            st.just(None), scalars, st.fixed_dictionaries({"torch": st.text(max_size=20)}),
            st.fixed_dictionaries({"torch": st.just("AAAA")}),
            st.just("python-garbage"), st.just("numpy-garbage")))
    if kind == "opt_shape":
        return kind, draw(st.integers(1, 7))
    if kind == "opt_key":
        return kind, draw(st.sampled_from(["state.x.exp_avg", "foo", "state.999.exp_avg",
                                           "state.0", "state.-1.exp_avg"]))
    if kind == "opt_meta":
        return kind, draw(st.sampled_from(["groups", "indices", "lr", "betas", "nontensor",
                                           "nontensor_idx"]))
    return kind, None  # model_other, state_other_config, opt_none


def forge(world: World, ckpt: Path, kind: str, arg: Any, seal: bool) -> None:
    """Apply one defect to a copy of a good checkpoint folder; `seal`: then make the manifest
    match again (only when every defect of the example is a forgery meant to pass it).

    A defect that cannot apply (its file was already deleted or made unparsable by an earlier
    defect) is skipped: the earlier one is defect enough.
    """
    try:
        _forge(world, ckpt, kind, arg)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            ZeroDivisionError, SafetensorError):
        return
    if seal and kind in SEALED:
        reseal(ckpt)


def _forge(world: World, ckpt: Path, kind: str, arg: Any) -> None:
    if kind in ("truncate", "append", "flip", "replace"):
        path = ckpt / arg[0]
        data = bytearray(path.read_bytes())
        if kind == "truncate":
            data = data[: max(0, len(data) - arg[1])]
        elif kind == "append":
            data += b"\0" * arg[1]
        elif kind == "flip":
            data[arg[1] % len(data)] ^= arg[2]
        else:
            assume(bytes(data) != arg[1])
            data = bytearray(arg[1])
        path.write_bytes(bytes(data))
    elif kind == "delete":
        (ckpt / arg).unlink()
    elif kind == "manifest_junk":
        (ckpt / layout.MANIFEST_FILE).write_bytes(arg)
    elif kind == "manifest_entry":
        how, name, junk = arg
        manifest = json.loads((ckpt / layout.MANIFEST_FILE).read_text())
        files = manifest["files"]
        if how == "drop":
            del files[name]
        elif how == "size":
            files[name]["size"] += 1
        elif how == "sha":
            files[name]["sha256"] = "0" * 64
        elif how == "badname":
            files["../" + name] = files.pop(name)
        elif how == "phantom":
            files["phantom.bin"] = {"size": 1, "sha256": "0" * 64}
        else:
            files[name] = junk
        (ckpt / layout.MANIFEST_FILE).write_text(json.dumps(manifest, default=str))
    elif kind in ("model_bytes", "opt_bytes"):
        name = layout.MODEL_FILE if kind == "model_bytes" else layout.OPTIM_FILE
        (ckpt / name).write_bytes(arg)
    elif kind == "model_other":
        shutil.copy(world.other / layout.MODEL_FILE, ckpt / layout.MODEL_FILE)
    elif kind in ("model_keys", "model_dtype", "model_nan"):
        tensors = load_file(str(ckpt / layout.MODEL_FILE))
        name = sorted(tensors)[0]
        if kind == "model_keys" and arg == "drop":
            del tensors[name]
        elif kind == "model_keys" and arg == "add":
            tensors["extra.weight"] = torch.zeros(2)
        elif kind == "model_keys":
            tensors["x" + name] = tensors.pop(name)
        elif kind == "model_dtype":
            tensors[name] = tensors[name].to(arg)
        else:
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[0] = arg
        save_file(tensors, str(ckpt / layout.MODEL_FILE))
    elif kind == "state_junk":
        (ckpt / layout.STATE_FILE).write_bytes(arg)
    elif kind == "state_field":
        edit_state(ckpt, lambda s: s.__setitem__(arg[0], arg[1]))
    elif kind == "state_config":
        edit_state(ckpt, lambda s: s.__setitem__("config", apply_defects(s["config"], arg)))
    elif kind == "state_other_config":
        other = json.loads((world.other / layout.STATE_FILE).read_text())["config"]
        edit_state(ckpt, lambda s: s.__setitem__("config", other))
    elif kind == "rng":
        def set_rng(s):
            if arg == "python-garbage":
                s["rng"]["python"] = [3, [1, 2, 3], None]
            elif arg == "numpy-garbage":
                s["rng"]["numpy"] = ["PCG64", [], 0, 0, 0.0]
            else:
                s["rng"] = arg
        edit_state(ckpt, set_rng)
    elif kind in ("opt_shape", "opt_key", "opt_dtype"):
        tensors = load_file(str(ckpt / layout.OPTIM_FILE))
        name = sorted(k for k in tensors if k.endswith("exp_avg"))[0]
        if kind == "opt_shape":
            tensors[name] = torch.zeros(tuple(tensors[name].shape) + (arg,))
        elif kind == "opt_key":
            tensors[arg] = tensors.pop(name)
        else:
            tensors[name] = tensors[name].to(arg)
        save_file(tensors, str(ckpt / layout.OPTIM_FILE))
    elif kind == "opt_meta":
        def bad_meta(s):
            groups = s["optimizer"]["param_groups"]
            if arg == "groups":
                groups.append(dict(groups[0]))
            elif arg == "indices":
                groups[0]["params"] = list(reversed(groups[0]["params"]))
            elif arg == "lr":
                groups[0]["lr"] = "fast"
            elif arg == "betas":
                groups[0]["betas"] = [0.9]
            elif arg == "nontensor":
                s["optimizer"]["nontensor_state"] = [1, 2]
            else:
                s["optimizer"]["nontensor_state"] = {"x": {"step": 1}}
        edit_state(ckpt, bad_meta)
    elif kind == "opt_none":
        edit_state(ckpt, lambda s: s.__setitem__("optimizer", None))


def checkpoint_argv(command: str, run: Path, ckpt: Path, d: Path, direct: bool) -> list[str]:
    target = str(ckpt if direct else run)
    return {"eval": ["eval", target, "--windows", "2"],
            "sample": ["sample", target, "--max-new-tokens", "2", "--prompt", "the"],
            "convert": ["convert", target, "--out", str(d / "converted")],
            "train": ["train", str(run), "--resume"]}[command]


@pytest.mark.slow
@settings(FUZZ, max_examples=250)
@given(defects=st.lists(ckpt_defect(), min_size=1, max_size=2),
       command=st.sampled_from(["eval", "sample", "convert", "train"]), direct=st.booleans())
# a whole sound checkpoint of another run, dropped into this one (found by the fuzzer in CI)
@example(defects=[("model_other", None), ("state_other_config", None)], command="eval",
         direct=False)
@example(defects=[("model_other", None), ("state_other_config", None)], command="sample",
         direct=True)
@example(defects=[("model_other", None), ("state_other_config", None)], command="convert",
         direct=False)
def test_malformed_checkpoints(world, defects, command, direct):
    seal = all(kind in SEALED for kind, _ in defects)
    with workdir(world) as d:
        d = Path(d)
        run = d / "run"
        shutil.copytree(world.run, run)
        ckpt = run / "ckpt-0000002"
        # forgeries parse the files they change: apply them before raw damage
        for kind, arg in sorted(defects, key=lambda ka: ka[0] not in SEALED):
            forge(world, ckpt, kind, arg, seal)
        if not seal:  # raw damage that undid itself (two equal flips) is no defect at all
            assume(ck.checkpoint_problem(ckpt) is not None)
        refused(checkpoint_argv(command, run, ckpt, d, direct), d, [world.data, world.run],
                "checkpoint")


@pytest.mark.slow
@settings(FUZZ, max_examples=60)
@given(defect=ckpt_defect(optimizer_only=True))
def test_malformed_optimizer_state_on_resume(world, defect):
    with workdir(world) as d:
        d = Path(d)
        run = d / "run"
        shutil.copytree(world.run, run)
        forge(world, run / "ckpt-0000002", *defect, seal=True)
        refused(["train", str(run), "--resume"], d, [world.data, world.run], "checkpoint")


@st.composite
def tokenizer_defect(draw) -> tuple[str, bytes]:
    """A damaged file of the run's own tokenizer copy (what `sample` decodes with)."""
    name = draw(st.sampled_from(["meta.json", "char_vocab.json"]))
    junk_json = values.map(lambda v: json.dumps(v, default=str).encode())
    if name == "meta.json":
        content = draw(st.one_of(
            st.binary(max_size=40), junk_json,
            st.sampled_from(["bytes", "bpe:300", "char ", "", "bpe:x"]).map(
                lambda t: json.dumps({"tokenizer": t}).encode()),
            st.one_of(st.integers(), st.text(max_size=3)).map(
                lambda v: json.dumps({"tokenizer": "char", "vocab_size": v}).encode())))
    else:
        content = draw(st.one_of(
            st.binary(max_size=40), junk_json,
            values.map(lambda v: json.dumps({"chars": v}, default=str).encode())))
    return name, content


def _plausible_vocab(content: bytes, size: int) -> bool:
    try:
        chars = json.loads(content)["chars"]
        return len({c for c in chars if isinstance(c, str) and len(c) == 1}) == size
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return False


@pytest.mark.slow
@settings(FUZZ, max_examples=60)
@given(defect=tokenizer_defect())
def test_malformed_run_tokenizer(world, defect):
    name, content = defect
    with workdir(world) as d:
        d = Path(d)
        run = d / "run"
        shutil.copytree(world.run, run)
        path = run / "tokenizer" / name
        assume(content != path.read_bytes())
        # a generated vocabulary that happens to be a valid one is no defect
        assume(not (name == "char_vocab.json" and _plausible_vocab(content, world.vocab)))
        path.write_bytes(content)
        refused(["sample", str(run), "--max-new-tokens", "2", "--prompt", "the"], d,
                [world.data, world.run], "tokenizer")


def test_a_good_checkpoint_still_loads(world, capsys):
    """The control for the two tests above: the untouched copy is accepted by every command."""
    with workdir(world) as d:
        d = Path(d)
        run = d / "run"
        shutil.copytree(world.run, run)
        reseal(run / "ckpt-0000002")  # sealing alone changes nothing
        for command in ("eval", "sample", "convert"):
            for direct in (True, False):
                argv = checkpoint_argv(command, run, run / "ckpt-0000002", d, direct)
                assert main(argv) == 0, argv
        assert main(["train", str(run), "--resume", "--set", "train.max_steps=3"]) == 0


# ---- command-line arguments ---------------------------------------------------------------
def _options(command: str) -> dict[str, Any]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    return {s: a for a in sub._actions for s in a.option_strings if s.startswith("--")}


TYPED = sorted((c, o, a.type) for c in COMMANDS for o, a in _options(c).items()
               if a.type in (int, float))
REQUIRED = sorted(c for c in COMMANDS if any(
    a.required for a in build_parser()._subparsers._group_actions[0].choices[c]._actions
    if not a.option_strings and a.nargs is None))


@st.composite
def usage_error(draw) -> list[str]:
    kind = draw(st.sampled_from(["unknown_option", "bad_number", "missing", "no_command",
                                 "bad_command"]))
    if kind == "unknown_option":
        command = draw(st.sampled_from(sorted(COMMANDS)))
        return [command, "--zz-" + draw(st.from_regex(r"[a-z0-9-]{0,8}", fullmatch=True)),
                *draw(st.lists(st.text(max_size=5).filter(lambda t: not t.startswith("-")),
                               max_size=2))]
    if kind == "bad_number":
        command, option, kind_ = draw(st.sampled_from(TYPED))
        junk = st.text(max_size=6).filter(lambda t: "\0" not in t)
        if kind_ is int:
            junk = junk.filter(lambda t: not re.fullmatch(r"\s*[-+]?\d+(_\d+)*\s*", t))
        else:
            junk = junk.filter(lambda t: not _is_float(t))
        return [command, f"{option}={draw(junk)}"]
    if kind == "missing":
        return [draw(st.sampled_from(REQUIRED))]
    if kind == "no_command":
        return []
    return ["zz-" + draw(st.from_regex(r"[a-z]{1,8}", fullmatch=True))]


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@settings(FUZZ, max_examples=100)
@given(argv=usage_error())
def test_usage_errors_are_one_line(world, argv):
    with workdir(world) as d:
        refused(argv, Path(d), [world.data, world.run], "argv usage")


@st.composite
def bad_sample_or_eval(draw) -> list[str]:
    """A sample/eval command line with at least one value out of range, the rest valid."""
    if draw(st.booleans()):
        windows = draw(st.one_of(st.integers(max_value=0), st.integers(min_value=10**12)))
        return ["eval", "RUN", "--windows", str(windows)]
    bad = {"--max-new-tokens": st.integers(max_value=-1),
           "--num-samples": st.one_of(st.integers(max_value=0), st.integers(min_value=10**12)),
           "--temperature": st.one_of(st.floats(max_value=-1e-9), st.just(float("nan")),
                                      st.just(float("inf"))),
           "--top-k": st.integers(max_value=0),
           "--top-p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001),
                                st.just(float("nan"))),
           "--stop-token": st.one_of(st.integers(max_value=-1), st.integers(min_value=100)),
           "--seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=1 << 63))}
    good = {"--max-new-tokens": st.integers(0, 3), "--num-samples": st.integers(1, 2),
            "--temperature": st.floats(0, 2), "--top-k": st.integers(1, 50),
            "--top-p": st.floats(0.01, 1.0), "--stop-token": st.integers(0, 20),
            "--seed": st.integers(0, 2**32)}
    broken = draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3, unique=True))
    argv = ["sample", "RUN", "--prompt", "the"]
    for option in sorted(bad):
        if option in broken:
            argv += [f"{option}={draw(bad[option])}"]
        elif draw(st.booleans()):
            argv += [f"{option}={draw(good[option])}"]
    return argv


@pytest.mark.slow
@settings(FUZZ, max_examples=80)
@given(argv=bad_sample_or_eval())
def test_out_of_range_sample_and_eval_arguments(world, argv):
    with workdir(world) as d:
        argv = [str(world.run) if a == "RUN" else a for a in argv]
        refused(argv, Path(d), [world.data, world.run], "argv values")


@pytest.mark.parametrize("args", [
    ["--set", "noequals"], ["--set", "train=1"], ["--set", "a.b.c=1"], ["--set", ".x=1"],
    ["--set", "train.=1"], ["--set", "nosuch.key=1"], ["--set", "train.max_steps="],
])
def test_bad_set_syntax(world, args):
    with workdir(world) as d:
        d = Path(d)
        cfg = save_config(load_config("shakespeare-char", bare_overrides(world.data,
                                                                          world.vocab)),
                          d / "good.toml")
        refused(["train", str(cfg), "--out", str(d / "run"), *args], d, [world.data],
                "argv values")


@pytest.mark.parametrize("case", ["missing", "folder", "binary", "out_is_file",
                                  "prepare_tokenizer", "prepare_num_proc", "prepare_fraction",
                                  "eval_empty_dir", "convert_bad_target"])
def test_bad_paths_and_prepare_arguments(world, case):
    with workdir(world) as d:
        d = Path(d)
        (d / "afile").write_bytes(b"\x00\x01")
        (d / "empty").mkdir()
        argv = {
            "missing": ["train", str(d / "nope.toml")],
            "folder": ["train", str(d / "empty")],
            "binary": ["train", str(d / "afile")],
            "out_is_file": ["train", str(save_config(load_config("shakespeare-char",
                            bare_overrides(world.data, world.vocab)), d / "c.toml")),
                            "--out", str(d / "afile")],
            "prepare_tokenizer": ["prepare", "shakespeare", "--tokenizer", "bpe:-3", "--out",
                                  str(d / "p")],
            "prepare_num_proc": ["prepare", "shakespeare", "--num-proc", "0", "--out",
                                 str(d / "p")],
            "prepare_fraction": ["prepare", "shakespeare", "--val-fraction", "1.5", "--out",
                                 str(d / "p")],
            "eval_empty_dir": ["eval", str(d / "empty")],
            "convert_bad_target": ["convert", str(world.run), "--to", "w-identity", "--out",
                                   str(d / "c")],
        }[case]
        refused(argv, d, [world.data, world.run], "argv values")


# ---- pickles with a payload ---------------------------------------------------------------
class Payload:
    """Unpickling this creates `marker`: proof that something executed the pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def unpickle_elsewhere(raw: bytes, loader: str, tmp: Path) -> None:
    """The control: load `raw` the unsafe way in a separate process (to show it is armed)."""
    path = tmp / "control.bin"
    path.write_bytes(raw)
    code = ("import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())"
            if loader == "pickle" else
            "import sys, torch; torch.load(sys.argv[1], weights_only=False)")
    subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)})


@pytest.mark.slow
def test_pickle_payloads_are_refused_without_running(world, tmp_path):
    marker = tmp_path / "PWNED"
    control = tmp_path / "CONTROL"
    raw = pickle.dumps(Payload(marker))
    torch_zip = tmp_path / "payload.pt"
    torch.save({"model": Payload(marker)}, torch_zip)
    zipped = torch_zip.read_bytes()
    # the controls: the same payloads really run when something unpickles them
    unpickle_elsewhere(pickle.dumps(Payload(control)), "pickle", tmp_path)
    assert control.exists()
    control.unlink()
    torch.save({"model": Payload(control)}, tmp_path / "control.pt")
    unpickle_elsewhere((tmp_path / "control.pt").read_bytes(), "torch", tmp_path)
    assert control.exists()
    torch_zip.unlink()

    tried = 0
    for payload in (raw, zipped):
        for place in ("model", "optimizer", "standalone", "folder", "hf"):
            with workdir(world) as d:
                d = Path(d)
                run = d / "run"
                shutil.copytree(world.run, run)
                ckpt = run / "ckpt-0000002"
                commands: list[list[str]]
                if place in ("model", "optimizer"):
                    name = layout.MODEL_FILE if place == "model" else layout.OPTIM_FILE
                    (ckpt / name).write_bytes(payload)
                    reseal(ckpt)  # the manifest vouches for it: the loader must still refuse
                    (ckpt / "model.pt").write_bytes(payload)  # and a .pt beside it
                    commands = [["train", str(run), "--resume"]]
                    if place == "model":
                        commands += [["eval", str(ckpt)], ["sample", str(run)],
                                     ["convert", str(ckpt), "--out", str(d / "c")]]
                elif place == "standalone":
                    for suffix in ck.PICKLE_SUFFIXES:
                        (d / f"model{suffix}").write_bytes(payload)
                    commands = [[c, str(d / f"model{s}")] for c in ("eval", "sample", "convert")
                                for s in ck.PICKLE_SUFFIXES]
                elif place == "folder":
                    legacy = d / "legacy"
                    legacy.mkdir()
                    for name in ("ckpt.pt", "pytorch_model.bin", "model.pth", "state.pkl"):
                        (legacy / name).write_bytes(payload)
                    commands = [["eval", str(legacy)], ["sample", str(legacy)],
                                ["convert", str(legacy), "--out", str(d / "c")]]
                else:  # a Hugging Face folder with only a pickled pytorch_model.bin
                    hf = d / "hf"
                    hf.mkdir()
                    (hf / "pytorch_model.bin").write_bytes(payload)
                    (hf / "config.json").write_text(json.dumps({
                        "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32,
                        "n_positions": 16, "vocab_size": world.vocab}))
                    commands = [["import-hf", str(hf), "--out", str(d / "imported"),
                                 "--no-verify"]]
                for argv in commands:
                    refused(argv, d, [world.data, world.run], "pickle payload")
                    tried += 1
                    assert not marker.exists(), argv
    assert tried >= 30 and not marker.exists()


# ---- the source never unpickles, evals or execs -------------------------------------------
FORBIDDEN = {
    r"\btorch\.load\(": "torch.load unpickles",
    r"\btorch\.jit\.load\(": "TorchScript archives hold pickles",
    r"\bpickle\.(loads?|Unpickler)\b": "unpickling",
    r"\b(cPickle|dill|cloudpickle|joblib|shelve|marshal)\b": "pickle-like loaders",
    r"\b(np|numpy)\.load\(": "np.load can unpickle (allow_pickle)",
    r"\bread_pickle\(": "pandas unpickling",
    r"\byaml\.(unsafe_)?load\(": "YAML loaders can construct objects",
    r"weights_only\s*=\s*False": "explicit unpickling",
    r"(?<![\w.])(eval|exec|compile|__import__)\(": "executes text",
    r"\brunpy\b": "executes files",
    r"\bfrom_pretrained\((?!.*use_safetensors=True)": "may fall back to pytorch_model.bin",
}


def code_only(path: Path) -> dict[int, str]:
    """Each line's code with strings, docstrings and comments removed (via tokenize)."""
    skip = {tokenize.STRING, tokenize.COMMENT}
    skip |= {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
             if hasattr(tokenize, n)}
    lines: dict[int, list[str]] = {}
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type not in skip:
                lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: re.sub(r"\s*([.(=])\s*", r"\1", " ".join(parts)) for n, parts in lines.items()}


def scan(py: Path) -> list[str]:
    hits = []
    for lineno, code in code_only(py).items():
        for pattern, why in FORBIDDEN.items():
            if re.search(pattern, code):
                hits.append(f"{py.name}:{lineno}: {why}: {code}")
        if "import_module(" in code and py.name != "cli.py":
            hits.append(f"{py.name}:{lineno}: dynamic import: {code}")
    return hits


def test_no_code_path_unpickles_or_executes(tmp_path):
    hits = [h for py in sorted((SRC / "qkvlab").rglob("*.py")) for h in scan(py)]
    assert hits == []
    # the scan itself works: it finds these in code, and ignores them in strings and comments
    probe = tmp_path / "probe.py"
    probe.write_text('"""torch.load(x) in a docstring"""\n'
                     'msg = "pickle.loads(data)"  # eval(x) in a comment\n'
                     'model.eval()\n'
                     'state = torch.load(path, weights_only=False)\n'
                     'value = eval (text)\n'
                     'obj = pickle.loads(blob)\n'
                     'm = AutoModel.from_pretrained(str(d))\n'
                     'ok = AutoModel.from_pretrained(str(d), use_safetensors=True)\n')
    assert [h.split(":")[1] for h in scan(probe)] == ["4", "4", "5", "6", "7"]
