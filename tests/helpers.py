"""Helpers the test modules import (`from helpers import tiny_config`); fixtures live in
conftest.py. pytest puts this folder on sys.path (it has no __init__.py), as for conftest."""

import json
from pathlib import Path

from qkvlab.cli import main
from qkvlab.run.config import RunConfig, load_config

# The tiny run most training tests share, as `--set` overrides of the shakespeare-char preset:
# a 2 x 32 model (2 heads of 16), context 16, no dropout, batch 4, 8 steps of a few
# milliseconds each, fp32 on the CPU, no TensorBoard. `data.dir` and `model.vocab_size` come
# from the dataset; tests pass what they need different as further overrides.
TINY_RUN = (
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
    "model.dropout=0.0", "data.prepare_if_missing=false",
    "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=2",
    "train.max_steps=8", "train.batch_size=4", "train.grad_accum=1",
    "train.eval_interval=4", "train.eval_windows=8", "train.log_interval=1",
    "train.ckpt_interval=4", "train.keep_last=2", "train.peak_flops=1e12",
    "train.tensorboard=false", "train.dtype=fp32", "train.device=cpu",
)


def tiny_overrides(data_dir: Path, *changes: str, vocab: int | None = None) -> list[str]:
    """TINY_RUN on `data_dir`, each of `changes` ("section.key=value") replacing its key.

    The vocabulary is the dataset's (read from its meta.json) unless `vocab` is given.
    """
    if vocab is None:
        vocab = json.loads((Path(data_dir) / "meta.json").read_text())["vocab_size"]
    items = [f"model.vocab_size={vocab}", f"data.dir={data_dir}", *TINY_RUN, *changes]
    merged = {item.partition("=")[0].strip(): item for item in items}  # the last one wins
    return list(merged.values())


def tiny_config(data_dir: Path, *changes: str, vocab: int | None = None) -> RunConfig:
    """The resolved shakespeare-char config with `tiny_overrides(data_dir, *changes)`."""
    return load_config("shakespeare-char", tiny_overrides(data_dir, *changes, vocab=vocab))


def refused(capsys, args: list[str]) -> str:
    """The one-line error of a `qkvlab` command that must exit 2 (no traceback)."""
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err
    return err
