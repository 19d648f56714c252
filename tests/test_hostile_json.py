"""Well-formed JSON of the wrong shape, and config sizes no weights back, through the CLI.

`qkvlab export`, `sample` and `import-hf` read JSON files that are data from disk: a tokenizer's
meta.json, a transformers config.json, an export's qkvlab_tokenizer/meta.json. A list where an
object goes, arrays nested 100,000 deep, a string where a count goes, or n_layer = 10**30 must
end in one line and exit 2, with no file changed anywhere, and never loop or allocate first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import refused, tiny_overrides
from qkvlab.cli import main
from qkvlab.hf.export import write_model_dir
from qkvlab.hf.llama import to_llama
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT

DEEP = 100_000  # levels of nesting: far past Python's recursion limit


@pytest.fixture(scope="module")
def folders(tmp_path_factory, data_dir) -> dict[str, Path]:
    """A trained tiny run, its GPT-2 export (with qkvlab's entry and qkvlab_tokenizer/) and a
    Llama model folder written from a fresh model."""
    root = tmp_path_factory.mktemp("sources")
    run = root / "run"
    sets = tiny_overrides(data_dir, "train.max_steps=2", "train.eval_interval=2",
                          "train.ckpt_interval=2")
    argv = ["train", "shakespeare-char", "--out", str(run)]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    gpt2 = root / "gpt2"
    assert main(["export", str(run), str(gpt2), "--no-verify"]) == 0
    torch.manual_seed(0)
    llama_model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=48,
                                  mlp="swiglu", norm="rmsnorm", positions="rope",
                                  mlp_hidden=64, dropout=0.0))
    config, tensors = to_llama(llama_model)
    llama = write_model_dir(root / "llama", config, tensors)
    return {"run": run, "gpt2": gpt2, "llama": llama}


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def refused_untouched(capsys, tmp_path: Path, argv: list[str]) -> str:
    """The one-line error of `argv` (exit 2, no traceback); no file under tmp_path (the work
    folder, the command's inputs and outputs) added, removed or changed."""
    before = snapshot(tmp_path)
    err = refused(capsys, argv)
    assert snapshot(tmp_path) == before
    return err


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def deep_array() -> str:
    return "[" * DEEP + "]" * DEEP


def deep_object() -> str:
    return '{"a": ' * DEEP + "1" + "}" * DEEP


# ---- the run's tokenizer/meta.json (and its tables): export and sample ----------------------

RUN_DEFECTS = {
    "meta-list": ("tokenizer/meta.json", "[1, 2]", "not a JSON object"),
    "meta-deep-array": ("tokenizer/meta.json", deep_array(), "nests deeper"),
    "meta-deep-object": ("tokenizer/meta.json", deep_object(), "nests deeper"),
    "meta-vocab-str": ("tokenizer/meta.json", None, "vocab_size must be a positive integer"),
    "char-vocab-deep": ("tokenizer/char_vocab.json", deep_array(), "nests deeper"),
}


def _spoil_run(run: Path, defect: str) -> None:
    name, text, _ = RUN_DEFECTS[defect]
    if text is None:  # the real meta.json, its vocab_size a string
        edit_json(run / name, lambda m: m.update(vocab_size=str(m["vocab_size"])))
    else:
        (run / name).write_text(text)


# export copies char_vocab.json as bytes: sample is the command that parses it
RUN_CASES = [(command, defect) for command in ("export", "sample") for defect in RUN_DEFECTS
             if (command, defect) != ("export", "char-vocab-deep")]


@pytest.mark.parametrize(("command", "defect"), RUN_CASES)
def test_run_tokenizer_json_of_the_wrong_shape(folders, tmp_path, monkeypatch, capsys, command,
                                               defect):
    monkeypatch.chdir(tmp_path)
    run = shutil.copytree(folders["run"], tmp_path / "run")
    _spoil_run(run, defect)
    argv = (["export", str(run), str(tmp_path / "out"), "--no-verify"] if command == "export"
            else ["sample", str(run), "--max-new-tokens", "4"])
    err = refused_untouched(capsys, tmp_path, argv)
    file, _, words = RUN_DEFECTS[defect]
    assert file in err and words in err, err


def test_export_over_a_folder_whose_config_json_nests_too_deep(folders, tmp_path, monkeypatch,
                                                               capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"qkvlab": ' + deep_array() + "}")
    err = refused_untouched(capsys, tmp_path, ["export", str(folders["run"]), str(out),
                                               "--no-verify"])
    assert "is not a qkvlab export" in err


# ---- import-hf: config.json, qkvlab_tokenizer/meta.json, --data meta.json ------------------

def _set(**fields) -> Callable[[dict], object]:
    return lambda config: config.update(fields)


IMPORT_DEFECTS = {
    "qkvlab-entry-list": ("config.json", _set(qkvlab=[1]), "qkvlab must be a JSON object"),
    "qkvlab-step-str": ("config.json", lambda c: c["qkvlab"].update(step="7"),
                        "step must be an integer"),
    "config-deep-array": ("config.json", deep_array(), "nests deeper"),
    "config-deep-field": ("config.json", '{"model_type": "gpt2", "x": ' + deep_array() + "}",
                          "nests deeper"),
    "tok-meta-list": ("qkvlab_tokenizer/meta.json", "[1, 2]", "not a JSON object"),
    "tok-meta-deep": ("qkvlab_tokenizer/meta.json", deep_object(), "nests deeper"),
    "tok-meta-vocab-str": ("qkvlab_tokenizer/meta.json", _set(vocab_size="101"),
                           "vocab_size must be a positive integer"),
    "tok-meta-spec-list": ("qkvlab_tokenizer/meta.json", _set(tokenizer=[1]),
                           "tokenizer must be a string"),
}


@pytest.mark.parametrize("defect", sorted(IMPORT_DEFECTS))
def test_import_json_of_the_wrong_shape(folders, tmp_path, monkeypatch, capsys, defect):
    monkeypatch.chdir(tmp_path)
    model_dir = shutil.copytree(folders["gpt2"], tmp_path / "model")
    name, change, words = IMPORT_DEFECTS[defect]
    if isinstance(change, str):
        (model_dir / name).write_text(change)
    else:
        edit_json(model_dir / name, change)
    err = refused_untouched(capsys, tmp_path, ["import-hf", str(model_dir), "--out",
                                               str(tmp_path / "ckpt")])
    assert name in err and words in err, err


@pytest.mark.parametrize("meta", ["[1, 2]", deep_array(), '{"tokenizer": "char", '
                                  '"vocab_size": "101"}'])
def test_import_data_meta_of_the_wrong_shape(folders, tmp_path, monkeypatch, capsys, meta):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(meta)
    err = refused_untouched(capsys, tmp_path, ["import-hf", str(folders["gpt2"]), "--out",
                                               str(tmp_path / "ckpt"), "--data", str(data)])
    assert "meta.json" in err


# ---- import-hf: sizes no tensors back, refused before anything is built --------------------

SIZE_DEFECTS = {
    # GPT-2's shape table had one entry per layer: 10**30 of them
    "gpt2-n_layer": ("gpt2", {"n_layer": 10**30}, "n_layer", "the weights hold 2 layer(s)"),
    # Llama's model was built (allocated: 4 GB, 16 GB) before its tensors' shapes were compared
    "llama-intermediate_size": ("llama", {"intermediate_size": 10**9}, "intermediate_size",
                                "larger than every"),
    "llama-hidden_size": ("llama", {"hidden_size": 65536, "head_dim": None}, "hidden_size",
                          "larger than every"),
}


@pytest.mark.parametrize("defect", sorted(SIZE_DEFECTS))
def test_import_sizes_beyond_the_tensors_present(folders, tmp_path, monkeypatch, capsys, defect):
    monkeypatch.chdir(tmp_path)
    source, fields, key, words = SIZE_DEFECTS[defect]
    model_dir = shutil.copytree(folders[source], tmp_path / "model")
    edit_json(model_dir / "config.json", _set(**fields))
    err = refused_untouched(capsys, tmp_path, ["import-hf", str(model_dir), "--out",
                                               str(tmp_path / "ckpt")])
    assert key in err and words in err, err


# ---- the same reader for a data folder's meta.json and a run's records ---------------------

def test_eval_on_a_data_folder_whose_meta_json_nests_too_deep(folders, data_dir, tmp_path,
                                                              monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = shutil.copytree(data_dir, tmp_path / "data")
    (data / "meta.json").write_text(deep_object())
    err = refused_untouched(capsys, tmp_path, ["eval", str(folders["run"]), "--data", str(data),
                                               "--windows", "2"])
    assert "meta.json is unreadable" in err


def test_run_records_of_the_wrong_shape_read_as_unfinished(tmp_path):
    from qkvlab.run.records import is_finished, read_json_record

    record = tmp_path / "summary.json"
    record.write_text(deep_array())
    assert read_json_record(record) is None
    for steps in ("eight", [8], None, True):
        assert not is_finished({"steps": steps}, 1)
    assert is_finished({"steps": 8}, 8)
