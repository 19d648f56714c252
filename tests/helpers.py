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


def modes_binding_prefix() -> list[str] | None:
    """A command prefix under which file modes bind a child process, or None where none can be
    made (the test skips). A plain user needs none; root (whom `chmod 555` does not stop)
    gets setpriv dropping the capabilities that override file modes, checked to work here."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    caps = "-dac_override,-dac_read_search,-fowner"
    prefix = [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o555)
        try:
            probe = subprocess.run([*prefix, sys.executable, "-c",
                                    f"open({folder + '/probe'!r}, 'w')"], capture_output=True)
        except OSError:
            return None
        finally:
            os.chmod(folder, 0o755)
    return prefix if probe.returncode != 0 else None


def run_qkvlab_bound_by_modes(args: list[str], cwd: Path, env: dict[str, str] | None = None):
    """`qkvlab ARGS` in a child process that file modes bind (skips the test where none can be
    started), `env` added to its environment; returns the CompletedProcess (text output)."""
    import os
    import subprocess
    import sys

    import pytest

    import qkvlab

    prefix = modes_binding_prefix()
    if prefix is None:
        pytest.skip("needs a non-root user, or setpriv to make file modes bind root")
    src = Path(qkvlab.__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src), **(env or {})}
    return subprocess.run([*prefix, sys.executable, "-m", "qkvlab", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)
