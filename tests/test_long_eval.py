"""The final validation loss over many tokens of the whole split, per part of the corpus, and
the machine record in summary.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from helpers import tiny_config
from qkvlab.data.loader import TokenData, spread_starts
from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import config_identity
from qkvlab.run.config import RESUME_HARMLESS, load_config
from qkvlab.run.load import load_model
from qkvlab.train.long_eval import target_labels
from qkvlab.train.trainer import train


@given(n=st.integers(2, 5_000), block=st.integers(1, 300), tokens=st.integers(1, 10_000))
@settings(max_examples=80, deadline=None)
def test_spread_windows_cover_the_split_end_to_end_and_share_no_target(n, block, tokens):
    assume(n >= block + 1)
    starts = spread_starts(n, block, tokens)
    count = min(-(-tokens // block), (n - 1) // block)
    assert len(starts) == count and starts[0] == 0
    if count > 1:
        assert starts[-1] == n - block - 1  # the last window ends at the split's end
    assert np.all(np.diff(starts) >= block)  # targets s+1 .. s+block never shared
    assert np.array_equal(starts, spread_starts(n, block, tokens))  # no random draw


def test_targets_are_labelled_with_the_span_that_holds_them():
    spans = [("a", 0, 5), ("b", 5, 9), ("a", 12, 20)]  # 9..11 lies in no span
    labels = target_labels(np.array([0, 8]), 4, spans)
    # targets of the window at 0 are tokens 1..4, of the window at 8 tokens 9..12
    assert labels.tolist() == [[0, 0, 0, 0], [3, 3, 3, 2]]
    assert target_labels(np.array([3]), 2, []).tolist() == [[0, 0]]


def with_spans(data_dir: Path, tmp_path: Path, spans) -> Path:
    """A copy of the prepared folder whose meta.json records `spans`."""
    out = tmp_path / "data"
    shutil.copytree(data_dir, out)
    meta = json.loads((out / "meta.json").read_text())
    meta["source_spans"] = spans
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def token_losses(run_dir: Path, data: TokenData, starts: np.ndarray, block: int) -> np.ndarray:
    """The per-target losses of a run's final weights, computed here from scratch in eval mode."""
    model, _ckpt = load_model(run_dir)
    x, y = data.val_windows_at(starts, block)
    with torch.no_grad():
        logits, _ = model(x)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").double().numpy()


def test_the_final_long_loss_scores_the_whole_split_per_source_in_eval_mode(data_dir, tmp_path):
    n_val = TokenData(data_dir).val_tokens
    cut = n_val // 3
    data = with_spans(data_dir, tmp_path, {"val": [["dictionary", 0, cut],
                                                  ["bible", cut, n_val]]})
    # dropout on: a loss measured in train mode would not match the one computed below
    cfg = tiny_config(data, "model.dropout=0.1", f"run.out_dir={tmp_path / 'run'}")
    summary = train(cfg, quiet=True)
    long = summary["final_val_loss_long"]
    block = cfg.model.block_size
    starts = spread_starts(n_val, block, cfg.train.final_eval_tokens)
    assert long["windows"] == len(starts) == (n_val - 1) // block  # all of a small split
    assert long["tokens"] == len(starts) * block and long["seconds"] > 0
    td = TokenData(data)
    ce = token_losses(tmp_path / "run", td, starts, block)
    assert long["loss"] == pytest.approx(ce.mean(), rel=1e-5)
    pos = starts[:, None] + 1 + np.arange(block)
    by = long["by_source"]
    assert set(by) == {"dictionary", "bible"}
    assert by["dictionary"]["tokens"] == int((pos < cut).sum())
    assert by["dictionary"]["loss"] == pytest.approx(ce[pos < cut].mean(), rel=1e-5)
    assert by["bible"]["loss"] == pytest.approx(ce[pos >= cut].mean(), rel=1e-5)
    assert by["dictionary"]["tokens"] + by["bible"]["tokens"] == long["tokens"]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["final_val_loss_long"] == long
    # resuming the finished run only measures again: the same numbers, bit for bit
    again = train(cfg, resume=True, quiet=True)["final_val_loss_long"]
    assert {k: v for k, v in again.items() if k != "seconds"} == \
        {k: v for k, v in long.items() if k != "seconds"}


def test_final_eval_tokens_sets_the_count_and_zero_turns_it_off(data_dir, tmp_path):
    few = train(tiny_config(data_dir, "train.max_steps=2", "train.final_eval_tokens=40",
                            f"run.out_dir={tmp_path / 'a'}"), quiet=True)
    # 40 targets in windows of 16: 3 windows, the first at 0 and the last at the end
    assert few["final_val_loss_long"]["tokens"] == 48
    assert few["final_val_loss_long"]["windows"] == 3
    assert "by_source" not in few["final_val_loss_long"]  # the folder records no parts
    off = train(tiny_config(data_dir, "train.max_steps=2", "train.final_eval_tokens=0",
                            f"run.out_dir={tmp_path / 'b'}"), quiet=True)
    assert off["final_val_loss_long"] is None
    with pytest.raises(QkvlabError, match="final_eval_tokens must be >= 0"):
        tiny_config(data_dir, "train.final_eval_tokens=-1")


def test_final_eval_tokens_stays_out_of_fingerprints_and_resumes(data_dir):
    assert "train.final_eval_tokens" in RESUME_HARMLESS
    a = tiny_config(data_dir)
    b = tiny_config(data_dir, "train.final_eval_tokens=0")
    assert a.train.final_eval_tokens == 1 << 20
    assert config_identity(a) == config_identity(b)  # archived sweeps keep their identity
    assert "final_eval_tokens" not in config_identity(a)["train"]


def test_a_config_saved_before_the_key_reads_with_the_default(tmp_path):
    old = tmp_path / "config.toml"
    old.write_text('[train]\nmax_steps = 4\n[model]\nattn_scale = "paper"\n')
    assert load_config(old).train.final_eval_tokens == 1 << 20


def test_summary_names_the_machine_and_dtype(data_dir, tmp_path):
    summary = train(tiny_config(data_dir, "train.max_steps=1", "train.final_eval_tokens=0",
                                f"run.out_dir={tmp_path / 'a'}"), quiet=True)
    machine = summary["machine"]
    assert machine["torch"] == torch.__version__
    assert machine["cpu"] and machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "gpu" not in machine and summary["dtype"] == "fp32"


@pytest.mark.parametrize("spans", [
    {"val": [["a", 0, 10**9]]},  # past the split's end
    {"val": [["a", 5, 9], ["b", 0, 4]]},  # out of order
    {"val": [["", 0, 4]]},  # no part name
    {"test": []},  # no such split
    [["a", 0, 4]],  # not a table
])
def test_malformed_source_spans_are_refused(data_dir, tmp_path, spans):
    with pytest.raises(QkvlabError, match="meta.json is malformed: source_spans"):
        TokenData(with_spans(data_dir, tmp_path, spans))


def test_a_folder_without_spans_reads_as_before(data_dir):
    data = TokenData(data_dir)
    assert "source_spans" not in data.meta and data.source_spans("val") is None
