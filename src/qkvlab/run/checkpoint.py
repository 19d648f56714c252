"""One checkpoint folder: safetensors + JSON, written atomically, verified by a manifest.

A checkpoint is a folder (`ckpt-0001000/`, or `best/`) holding

    model.safetensors      the model's state_dict (a tied head is stored once, as wte.weight)
    optimizer.safetensors  AdamW's per-parameter tensors as "state.{param_idx}.{name}"
    state.json             step, tokens, losses, the run config, optimizer hyperparameters,
                           RNG states (base64), versions
    manifest.json          size and sha256 of each file above

Nothing is ever unpickled: there is no torch.load here, only safetensors and json. A folder is
first written as `.tmp-ckpt-*` next to its destination, fsync'd and then renamed, so a crash
leaves either the old checkpoint or the new one, never half of one. Which checkpoint of a run
to read, and which to keep, is run/store.py's business; saving and restoring a training run,
on every process of a job, is train/checkpointer.py's.

The writer and the reader take plain state dicts (a model's `state_dict()`, an optimizer's
`state_dict()`), so a sharded model's gathered states are written like any other.
`on_write_stage` is the one fault-injection hook of every checkpoint write (crash tests).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from qkvlab import __version__
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import follow_umask, fsync_dir, fsync_file, sha256_file
from qkvlab.model import ModelConfig
from qkvlab.run import guard
from qkvlab.run.config import RunConfig, as_recorded, read_config_source, saved_config
from qkvlab.run.layout import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    OLD_PREFIX,
    OPTIM_FILE,
    STATE_FILE,
    TMP_PREFIX,
    ckpt_step,
    list_checkpoints,
)
from qkvlab.run.rng import is_int, rng_state
from qkvlab.run.validate import KERNEL_KEYS, optimizer_problem, state_problem

FORMAT = "qkvlab-checkpoint"
FORMAT_VERSION = 1
TIED_KEY = "lm_head.weight"
# Suffixes of files made by torch.save / pickle: named in errors, never opened.
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")


class CorruptCheckpoint(QkvlabError):
    """A checkpoint folder whose files do not match its manifest."""


class CheckpointWriteError(QkvlabError, OSError):
    """Writing a checkpoint failed (disk full, read-only, ...); the older ones are intact.

    Also an OSError, so code that catches the underlying OSError keeps working.
    """


# ---- crash-test fault injection ----------------------------------------------------------
SLOW_CKPT_ENV = "QKVLAB_TEST_SLOW_CKPT"
# Every point of a checkpoint write where a crash must leave a run that resumes: the files of
# the folder, the swap with an older folder of the same name, then (train/checkpointer.py) the
# run's `latest` and the pruning of old checkpoints.
WRITE_STAGES = (
    "model written",
    "optimizer written",
    "state written",
    "manifest written",
    "old checkpoint renamed aside",
    "checkpoint complete, latest not yet updated",
    "latest updated, not yet pruned",
)


def on_write_stage(stage: str) -> None:
    """The fault-injection hook, called as each of WRITE_STAGES completes (a test hook).

    With QKVLAB_TEST_SLOW_CKPT=SECONDS in the environment it sleeps that long, so a crash test
    can SIGKILL a real training process in the middle of a write deterministically; a value
    that is not a number in (0, 60) is ignored, and unset it costs one dict lookup. In-process
    tests replace this function to fail at a chosen stage.
    """
    assert stage in WRITE_STAGES, stage
    raw = os.environ.get(SLOW_CKPT_ENV)
    if not raw:
        return
    try:
        seconds = float(raw)
    except ValueError:
        return
    if 0 < seconds < 60:
        time.sleep(seconds)


# ---- tensors -> files ---------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The plain module behind torch.compile (its state_dict keys carry no `_orig_mod.`)."""
    return getattr(model, "_orig_mod", model)


def model_tensors(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A model state dict on the CPU; with `tied`, the head is dropped (safetensors refuses
    shared tensors, and wte.weight holds it)."""
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()
            if not (tied and k == TIED_KEY)}


def optimizer_payload(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors for optimizer.safetensors, JSON-able rest) of an optimizer.state_dict()."""
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, dict[str, Any]] = {}
    for idx, pstate in sd["state"].items():
        for name, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().to("cpu").contiguous()
            else:
                other.setdefault(str(idx), {})[name] = value
    groups = []
    for group in sd["param_groups"]:
        g = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):  # e.g. a tensor lr under capturable
                value = value.item()
            g[key] = list(value) if isinstance(value, tuple) else value
        groups.append(g)
    # the tensor names, so a load can tell a complete optimizer file from a swapped or emptied one
    return tensors, {"param_groups": groups, "nontensor_state": other,
                     "tensors": sorted(tensors)}


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer | np.floating):
        return value.item()
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def _write_files(tmp: Path, model: dict[str, torch.Tensor], cfg: RunConfig,
                 optimizer: dict[str, Any] | None, state: dict[str, Any] | None) -> None:
    """Model, optimizer, state.json and the manifest into the fresh folder `tmp`, fsync'd."""
    files = [MODEL_FILE]
    save_file(model_tensors(model, cfg.model.tie_embeddings), str(tmp / MODEL_FILE),
              metadata={"format": "pt"})
    follow_umask(tmp / MODEL_FILE)
    on_write_stage("model written")
    opt_json = None
    if optimizer is not None:
        opt_tensors, opt_json = optimizer_payload(optimizer)
        save_file(opt_tensors, str(tmp / OPTIM_FILE), metadata={"format": "pt"})
        follow_umask(tmp / OPTIM_FILE)
        files.append(OPTIM_FILE)
        on_write_stage("optimizer written")
    info = dict(state or {})
    for key in ("best_val_loss", "val_loss", "train_loss"):
        if key in info:
            info[key] = _finite_or_none(info[key])
    full = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "qkvlab_version": __version__,
        "torch_version": torch.__version__,
        **info,
        "tied_embeddings": bool(cfg.model.tie_embeddings),
        "config": as_recorded(cfg).to_dict(),
        "optimizer": opt_json,
        "rng": rng_state(),
    }
    (tmp / STATE_FILE).write_text(
        json.dumps(full, indent=1, default=_json_default) + "\n", encoding="utf-8")
    files.append(STATE_FILE)
    on_write_stage("state written")
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "files": {}}
    for name in files:
        fsync_file(tmp / name)
        manifest["files"][name] = {"size": (tmp / name).stat().st_size,
                                   "sha256": sha256_file(tmp / name)}
    with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    on_write_stage("manifest written")


def write_checkpoint(
    dest: Path,
    model: dict[str, torch.Tensor],
    cfg: RunConfig,
    *,
    optimizer: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint folder at `dest` atomically (replacing an old one there).

    `model` is the model's state_dict (of the plain module, not a torch.compile wrapper; a
    tied head is stored once, as wte.weight), `optimizer` an optimizer.state_dict() numbered
    by parameter index, `state` adds fields such as step, tokens and best_val_loss to
    state.json.
    """
    dest = Path(dest)
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TMP_PREFIX}{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        _write_files(tmp, model, cfg, optimizer, state)
        if dest.exists():
            # Rename the old folder aside first: rename() cannot replace a non-empty folder.
            old = parent / f"{OLD_PREFIX}{dest.name}-{uuid.uuid4().hex[:8]}"
            os.replace(dest, old)
            on_write_stage("old checkpoint renamed aside")
        os.replace(tmp, dest)
        fsync_dir(parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not dest.exists():
            os.replace(old, dest)  # the new one never arrived: put the previous one back
        if isinstance(exc, OSError | SafetensorError) and not isinstance(exc, QkvlabError):
            # a full or broken disk is the machine's problem, not a bug: one line, and say
            # which checkpoint is still good (nothing of the old ones was touched)
            raise CheckpointWriteError(guard.storage_message(
                f"writing checkpoint {dest}", exc, last_good_checkpoint(parent))) from exc
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


# ---- verification -------------------------------------------------------------------------
def _manifest_files(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the manifest's file table, None) or (None, what is wrong with the manifest)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return None, f"file {MANIFEST_FILE}: not a {FORMAT} manifest"
    except FileNotFoundError:
        return None, f"file {MANIFEST_FILE}: missing"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        return None, f"file {MANIFEST_FILE}: unreadable ({type(exc).__name__})"
    return files, None


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint folder ("file X: why"), or None if it verifies."""
    files, problem = _manifest_files(path)
    if files is None:
        return problem
    for required in (MODEL_FILE, STATE_FILE):
        if required not in files:
            return f"file {MANIFEST_FILE}: does not list {required}"
    for known in (MODEL_FILE, OPTIM_FILE, STATE_FILE):
        # a file the manifest does not vouch for must never be read
        if known not in files and (path / known).exists():
            return f"file {known}: not listed in {MANIFEST_FILE}"
    for name, entry in files.items():
        if "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
            return f"file {MANIFEST_FILE}: bad file name {name!r}"
        if not isinstance(entry, dict):
            return f"file {MANIFEST_FILE}: bad entry for {name!r}"
        fpath = path / name
        if not fpath.is_file():
            return f"file {name}: missing"
        size = fpath.stat().st_size
        if size != entry.get("size"):
            return f"file {name}: {size} bytes, the manifest says {entry.get('size')}"
        if sha256_file(fpath) != entry.get("sha256"):
            return f"file {name}: sha256 differs from the manifest (altered)"
    return None


def _previous_good(path: Path) -> Path | None:
    """The newest verified ckpt-* of the same run older than `path` (or any, for best/)."""
    step = ckpt_step(path)
    for other in reversed(list_checkpoints(path.parent)):
        s = ckpt_step(other)
        if other == path or (step is not None and s is not None and s >= step):
            continue
        if checkpoint_problem(other) is None:
            return other
    return None


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest ckpt-* folder of a run that verifies against its manifest, else None."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if checkpoint_problem(ckpt) is None:
            return ckpt
    return None


def verify_checkpoint(path: Path) -> None:
    """Raise CorruptCheckpoint naming the bad file and the previous good checkpoint."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is None:
        return
    prev = _previous_good(path)
    where = (f"the previous good checkpoint is {prev} (delete {path} to resume from it)"
             if prev is not None else "there is no earlier good checkpoint in its run folder")
    raise CorruptCheckpoint(f"checkpoint {path} is corrupt ({problem}); {where}")


# ---- reading ------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A verified checkpoint folder: its config and state.json contents."""

    path: Path
    config: RunConfig
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def has_optimizer(self) -> bool:
        return self.state.get("optimizer") is not None and (self.path / OPTIM_FILE).is_file()


def _read_state(ckpt: Path) -> dict[str, Any]:
    """state.json of a verified folder, checked field by field."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(f"checkpoint {ckpt} is corrupt (file {STATE_FILE}: "
                                f"{' '.join(str(exc).split())})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT \
            or not isinstance(state.get("config"), dict):
        raise CorruptCheckpoint(f"checkpoint {ckpt} is corrupt (file {STATE_FILE}: not a "
                                f"{FORMAT} state)")
    version = state.get("format_version", 0)
    if not is_int(version):
        raise CorruptCheckpoint(f"checkpoint {ckpt} is corrupt (file {STATE_FILE}: "
                                f"format_version {version!r} is not an integer)")
    if version > FORMAT_VERSION:
        raise QkvlabError(
            f"checkpoint {ckpt} has format version {state['format_version']}, newer than this "
            f"qkvlab reads ({FORMAT_VERSION}): upgrade qkvlab"
        )
    problem = state_problem(ckpt, state)
    if problem:
        raise CorruptCheckpoint(f"checkpoint {ckpt} is corrupt (file {STATE_FILE}: {problem})")
    return state


def open_checkpoint(ckpt: Path) -> Checkpoint:
    """Verify and parse the checkpoint folder `ckpt` (no tensors are loaded yet)."""
    verify_checkpoint(ckpt)
    state = _read_state(ckpt)
    try:
        cfg = saved_config(state["config"])  # as the version that wrote it meant it
    except QkvlabError as exc:
        raise QkvlabError(f"checkpoint {ckpt} holds a config this qkvlab rejects: {exc}"
                          ) from None
    # state.json is data from disk: an absurd model there must not reach the allocator
    guard.model_memory_check(cfg.model, f"the model of checkpoint {ckpt}")
    _check_belongs_to_run(ckpt, cfg.model)
    return Checkpoint(path=ckpt, config=cfg, state=state)


def _check_belongs_to_run(ckpt: Path, model: ModelConfig) -> None:
    """A checkpoint inside a run folder must hold that run's model (its config.toml).

    One copied in from another run is a sound checkpoint, but eval, sample and convert would
    report it under this run's name. An unreadable config.toml says nothing either way: the
    checkpoint is self-contained, so it is then used as it is.
    """
    run_file = ckpt.parent / CONFIG_FILE
    if not run_file.is_file():
        return
    try:
        raw, _ = read_config_source(run_file)
        run_model = ModelConfig.from_dict(raw["model"])
    except (QkvlabError, KeyError, TypeError, ValueError, AttributeError):
        return
    diffs = [f"{f.name} {getattr(model, f.name)!r} vs {getattr(run_model, f.name)!r}"
             for f in fields(ModelConfig) if getattr(model, f.name) != getattr(run_model, f.name)]
    if diffs:
        raise QkvlabError(
            f"checkpoint {ckpt} does not hold the model of its run {ckpt.parent} "
            f"({'; '.join(diffs[:3])} in {run_file}): it came from elsewhere; copy the "
            "checkpoint folder out of the run to use it on its own"
        )


# ---- files -> tensors ---------------------------------------------------------------------
def _load_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        # e.g. a pickle renamed to model.safetensors: safetensors only parses, never executes
        why = " ".join(str(exc).split())[:200]
        raise CorruptCheckpoint(f"checkpoint {path.parent} is corrupt (file {path.name}: not "
                                f"readable {what} safetensors: {why})") from None


def _misfits(tensors: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> list[str]:
    """Missing, unexpected, misshapen and mistyped tensors of a model file, in words."""
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    bad = [f"{k} is {list(tensors[k].shape)} in the checkpoint but {list(v.shape)} in the model"
           for k, v in wanted.items() if k in tensors and tensors[k].shape != v.shape]
    bad += [f"{k} is {str(tensors[k].dtype).removeprefix('torch.')} in the checkpoint but "
            f"{str(v.dtype).removeprefix('torch.')} in the model" for k, v in wanted.items()
            if k in tensors and tensors[k].shape == v.shape
            and (tensors[k].is_floating_point() != v.is_floating_point()
                 or tensors[k].is_complex() != v.is_complex())]
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing[:4])}")
    if unexpected:
        parts.append(f"unexpected {', '.join(unexpected[:4])}")
    parts.extend(bad[:4])
    return parts


def load_model_state(model: nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's weights into `model`, checking names and shapes first."""
    model = unwrap(model)
    tensors = _load_tensors(ckpt.path / MODEL_FILE, "model")
    expected = model.state_dict()
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    wanted = {k: v for k, v in expected.items() if not (tied and k == TIED_KEY)}
    parts = _misfits(tensors, wanted)
    if parts:
        raise QkvlabError(
            f"checkpoint {ckpt.path} does not fit the model config ({'; '.join(parts)}): use the "
            "config the checkpoint was trained with"
        )
    nonfinite = sorted(k for k, t in tensors.items()
                       if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if nonfinite:
        raise QkvlabError(f"checkpoint {ckpt.path} holds non-finite weights "
                          f"({', '.join(nonfinite[:4])}): it comes from a diverged run; use an "
                          "earlier checkpoint")
    model.load_state_dict(tensors, strict=False)
    if tied:  # load_state_dict copies in place, so the head still shares wte's tensor
        assert model.lm_head.weight is model.wte.weight


def read_optimizer_state(ckpt: Checkpoint, current: dict[str, Any],
                         shapes: list[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """AdamW's moments and step counts of `ckpt` as an optimizer.state_dict(), bitwise.

    `current` is the state_dict() of the optimizer it is meant for and `shapes` the shapes of
    that optimizer's parameters in index order (None: not checked); everything is checked
    against them before the caller loads anything.
    """
    if not ckpt.has_optimizer:
        raise QkvlabError(f"checkpoint {ckpt.path} has no optimizer state (a best/ or converted "
                          "checkpoint): resume from a ckpt-* folder")
    meta = ckpt.state["optimizer"]
    tensors = _load_tensors(ckpt.path / OPTIM_FILE, "optimizer")
    groups_now = current["param_groups"]
    saved = meta["param_groups"]
    if len(saved) != len(groups_now) or any(len(a["params"]) != len(b["params"])
                                            for a, b in zip(saved, groups_now, strict=True)):
        raise QkvlabError(f"checkpoint {ckpt.path} has optimizer state for other parameters: "
                          "resume with the config the run was started with")
    problem = optimizer_problem(shapes, groups_now, saved, tensors,
                                meta.get("nontensor_state", {}))
    if problem is None and "tensors" in meta and meta["tensors"] != sorted(tensors):
        problem = f"{OPTIM_FILE} holds other tensors than state.json lists"
    if problem:
        raise CorruptCheckpoint(f"checkpoint {ckpt.path} is corrupt (optimizer state: {problem})")
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, rest in meta.get("nontensor_state", {}).items():
        state.setdefault(int(idx), {}).update(rest)
    groups = []
    for s, c in zip(saved, groups_now, strict=True):
        g = dict(s)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        for key in KERNEL_KEYS:
            if key in c:
                g[key] = c[key]
        groups.append(g)
    return {"state": state, "param_groups": groups}
