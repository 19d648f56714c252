"""Every name in a run folder, in one place, and how checkpoint folders are found by name.

    RUN_DIR/
        config.toml          the config the run was trained with (it names RUN_DIR)
        metrics.jsonl        one JSON record per logged step (run/metrics.py)
        summary.json         written when a training session ends
        failed.json          a sweep's record of a run that diverged
        reused.json          a sweep's record of where a copied run came from
        .lock                held while a process trains in the folder (run/lock.py)
        tokenizer/           meta.json and the tokenizer tables, so sampling needs no data dir
        tb/                  TensorBoard events (train.tensorboard)
        wandb/               W&B's own files: offline-run-*/ or run-*/ per session (train.wandb)
        wandb-run.json       the W&B run id, so a resumed run logs into the same W&B run
        latest               the name of the newest ckpt-* folder
        ckpt-NNNNNNN/        checkpoints (run/checkpoint.py for what is inside)
        best/                the checkpoint with the lowest val loss so far
        downstream/          `qkvlab eval --tasks` results, step-NNNNNNN[-K].json

Leftovers of interrupted writes (.tmp-ckpt-*, .trash-*, .old-*) are cleaned up by
run/store.py. This module imports nothing heavy: sweeps list run folders without torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from qkvlab.errors import QkvlabError

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
FAILED_FILE = "failed.json"
REUSED_FILE = "reused.json"  # in a run copied from another sweep by --reuse: from where
LOCK_FILE = ".lock"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_META = "meta.json"
TB_DIR = "tb"
WANDB_DIR = "wandb"  # wandb.init(dir=RUN_DIR) puts its files here; the name is W&B's
WANDB_RUN_FILE = "wandb-run.json"  # {"id": ..., "project": ..., "entity": ...}
LATEST_FILE = "latest"
BEST_DIR = "best"
DOWNSTREAM_DIR = "downstream"

# inside a checkpoint folder
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"

# A checkpoint folder is first written under TMP_PREFIX, then renamed into place.
TMP_PREFIX = ".tmp-ckpt-"
# Pruned checkpoints are renamed to .trash-* first (atomic) and deleted after, so a crash
# mid-delete never leaves a half-deleted ckpt-* folder that looks like a checkpoint.
TRASH_PREFIX = ".trash-"
# A replaced checkpoint folder waits under .old-NAME-xxxxxxxx until its successor is in place.
OLD_PREFIX = ".old-"
CKPT_RE = re.compile(r"^ckpt-(\d{7,})$")


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:07d}"


def ckpt_step(path: Path) -> int | None:
    """The step of a `ckpt-NNNNNNN` folder name, else None."""
    m = CKPT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The `ckpt-*` folders of a run, oldest first (not verified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and ckpt_step(p) is not None]
    return sorted(found, key=lambda p: ckpt_step(p) or 0)


def is_checkpoint_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file() or (Path(path) / STATE_FILE).is_file()


def checkpoint_out_dir(out: str | Path | None, default: Path, source: Path, source_is: str
                       ) -> Path:
    """The folder a new checkpoint goes to (`out`, else `default`), refused when it is the
    source itself (`source_is` names it in the message) or an existing folder other than a
    qkvlab checkpoint: writing a checkpoint replaces its destination, never a foreign folder."""
    dest = Path(out).expanduser() if out else default
    if dest.resolve() == Path(source).resolve():
        raise QkvlabError(f"--out {dest} is {source_is}: choose another folder")
    if dest.exists() and not (dest.is_dir() and is_checkpoint_dir(dest)):
        raise QkvlabError(f"--out {dest} exists and is not a qkvlab checkpoint folder: choose a "
                          "new folder")
    return dest
