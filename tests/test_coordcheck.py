"""`qkvlab coordcheck`: μP keeps every tensor's size flat across width; SP does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkvlab.cli import main
from qkvlab.experiments.coordcheck import TENSORS, growth

WIDTHS = "64,128,256,512"


def config(tmp_path: Path, data_dir: Path) -> Path:
    """2 layers, d_k = 64 (1 head at width 64, 8 at 512), characters of tinyshakespeare."""
    path = tmp_path / "cc.toml"
    path.write_text(f"""
[model]
n_layer = 2
n_head = 1
n_embd = 64
block_size = 64
vocab_size = 65
attn_scale = "standard"
[data]
dir = "{data_dir.as_posix()}"
source = "shakespeare"
tokenizer = "char"
prepare_if_missing = true
[optim]
weight_decay = 0.0
[train]
batch_size = 16
dtype = "fp32"
""")
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cc-data") / "shakespeare-char"


def check(tmp_path: Path, data_dir: Path, projection: str, par: str) -> dict:
    out = tmp_path / f"{projection}-{par}.json"
    assert main(["coordcheck", str(config(tmp_path, data_dir)), "--widths", WIDTHS,
                 "--steps", "4", "--lr", "3e-3", "--json", str(out),
                 "--set", f"model.projection={projection}",
                 "--set", f"model.parametrization={par}"]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("projection", ["baseline", "q-identity"])
def test_mup_is_flat_and_standard_grows(tmp_path, data_dir, projection):
    mup = check(tmp_path, data_dir, projection, "mup")
    assert mup["parametrization"] == "mup" and mup["projection"] == projection
    assert {r["tensor"] for r in mup["rows"]} == set(TENSORS)
    assert {r["width"] for r in mup["rows"]} == {64, 128, 256, 512}
    assert {r["step"] for r in mup["rows"]} == {0, 1, 2, 3, 4}
    for tensor in TENSORS:  # every tensor within 2.5x from width 64 to 512
        assert growth(mup, tensor) <= 2.5, (tensor, growth(mup, tensor))
    sp = check(tmp_path, data_dir, projection, "standard")
    # SP's logits grow (Adam moves each projection's output by about d x lr)
    assert max(growth(sp, "attn_logits"), growth(sp, "output_logits")) >= 3.0
    plot = tmp_path / "cc.png"
    assert main(["coordcheck", str(config(tmp_path, data_dir)), "--widths", "64,128",
                 "--steps", "1", "--against", str(tmp_path / f"{projection}-standard.json"),
                 "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize("args,message", [
    (["--widths", "64,abc"], "--widths takes integers separated by commas"),
    ([], "give --widths or --depths"),
    (["--widths", "64", "--depths", "2"], "give --widths or --depths"),
    (["--widths", "64,96"], "width 96 is not a multiple of the head size 64"),
    (["--widths", "64", "--steps", "0"], "--steps must be at least 1"),
    (["--widths", "64", "--against", "missing.json"], "missing.json"),
])
def test_bad_input_is_one_line(tmp_path, data_dir, capsys, args, message):
    assert main(["coordcheck", str(config(tmp_path, data_dir)), *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
