"""Which checkpoints a run folder keeps and which one a reader gets.

The policy: a training checkpoint is `ckpt-{step}`, `latest` names the newest one
(`point_latest`), all but the newest keep_last are pruned (`prune`), `best/` holds the lowest
val loss; train/checkpointer.py writes them in that order. A reader given a run folder gets
`latest`, else the newest ckpt-* that verifies, else best/.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from qkvlab.errors import QkvlabError
from qkvlab.fsutil import write_text_atomic
from qkvlab.run import guard
from qkvlab.run.checkpoint import (
    PICKLE_SUFFIXES,
    Checkpoint,
    CheckpointWriteError,
    checkpoint_problem,
    last_good_checkpoint,
    open_checkpoint,
)
from qkvlab.run.layout import (
    BEST_DIR,
    CKPT_RE,
    LATEST_FILE,
    OLD_PREFIX,
    TMP_PREFIX,
    TOKENIZER_DIR,
    TRASH_PREFIX,
    is_checkpoint_dir,
    list_checkpoints,
)


def point_latest(run_dir: Path, ckpt: Path) -> None:
    """Make `latest` name the complete checkpoint `ckpt` (atomically)."""
    try:
        write_text_atomic(run_dir / LATEST_FILE, ckpt.name + "\n")
    except OSError as exc:
        # the new checkpoint is complete; `latest` still names the previous one
        raise CheckpointWriteError(guard.storage_message(
            f"updating {run_dir / LATEST_FILE}", exc, last_good_checkpoint(run_dir))) from exc


def check_latest(run_dir: Path) -> None:
    """Refuse a `latest` that point_latest could not replace (a folder, say): found at the
    first checkpoint, it would cost the training done until then."""
    latest = run_dir / LATEST_FILE
    if os.path.lexists(latest) and not latest.is_file():
        kind = "a folder" if latest.is_dir() else "not a regular file"
        raise QkvlabError(f"{latest} is {kind}, but it must be the file naming the newest "
                          f"checkpoint: move it out of the run folder (qkvlab writes it anew at "
                          "the next checkpoint; reading the run does not need it)")


def prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    """Remove all but the newest keep_last ckpt-* folders (never `keep`, the one just written)."""
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if old != keep:
            _discard(old)


def _discard(path: Path) -> None:
    """Delete a folder so that it vanishes at once: rename to .trash-*, then remove."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def clean_temp(run_dir: Path) -> None:
    """Remove leftovers of interrupted checkpoint writes (call only while holding the lock)."""
    for p in Path(run_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(run_dir).glob(f"{TRASH_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)
    for folder in (Path(run_dir), Path(run_dir) / TOKENIZER_DIR):
        # temp files of qkvlab.fsutil.write_bytes_atomic (".NAME.xxxx.tmp") cut short by a crash
        for p in folder.glob(".*.tmp"):
            if p.is_file():
                p.unlink(missing_ok=True)
    for p in Path(run_dir).glob(f"{OLD_PREFIX}*"):
        # .old-NAME-xxxxxxxx: a crash between the two renames of write_checkpoint leaves the
        # previous NAME here with nothing in its place; put it back rather than lose it
        name = p.name.removeprefix(OLD_PREFIX).rsplit("-", 1)[0]
        target = Path(run_dir) / name
        if name and not target.exists():
            os.replace(p, target)
        else:
            shutil.rmtree(p, ignore_errors=True)


def storage_error(exc: OSError, run_dir: Path) -> QkvlabError | None:
    """A one-line error for a full/read-only disk during a run, naming the last good
    checkpoint; None for an OSError that is not about storage (a bug: keep its traceback)."""
    if isinstance(exc, QkvlabError):
        return exc
    if not guard.is_storage_error(exc):
        return None
    name = getattr(exc, "filename", None)
    # some libraries (TensorBoard's writer) give the name as bytes: shown as the path it is
    what = f"writing {os.fsdecode(name)}" if name else "writing the run"
    return QkvlabError(guard.storage_message(what, exc, last_good_checkpoint(run_dir), run_dir))


def _refuse_pickle(path: Path) -> QkvlabError:
    return QkvlabError(
        f"{path} is a single file, not a qkvlab checkpoint folder; qkvlab never unpickles files "
        "(no torch.load): give a run folder or a ckpt-* folder written by `qkvlab train`"
    )


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint folder or a run folder (its `latest`, else the
    newest valid ckpt-*, else best/)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise QkvlabError(f"{path} does not exist: give a run folder or a checkpoint folder")
    if path.is_file():
        raise _refuse_pickle(path)
    if is_checkpoint_dir(path):
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        try:
            name = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""  # a damaged `latest` is only a hint: fall back to scanning
        if CKPT_RE.match(name) and (path / name).is_dir():
            return path / name
    for ckpt in reversed(list_checkpoints(path)):
        if checkpoint_problem(ckpt) is None:
            return ckpt
    if is_checkpoint_dir(path / BEST_DIR):
        return path / BEST_DIR
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    extra = (f" (found {', '.join(pickles)}: pickle files are never loaded)" if pickles else "")
    raise QkvlabError(
        f"no qkvlab checkpoint in {path}{extra}: train with `qkvlab train CONFIG --out {path}` "
        "or give a checkpoint folder"
    )


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Find, verify and parse a checkpoint (no tensors are loaded yet)."""
    return open_checkpoint(find_checkpoint(path))
