"""Checkpoints: safetensors + JSON folders, written atomically, verified by a manifest.

A checkpoint is a folder (`ckpt-0001000/`, or `best/`) holding

    model.safetensors      the model's state_dict (a tied head is stored once, as wte.weight)
    optimizer.safetensors  AdamW's per-parameter tensors as "state.{param_idx}.{name}"
    state.json             step, tokens, losses, the run config, optimizer hyperparameters,
                           RNG states (base64), versions
    manifest.json          size and sha256 of each file above

Nothing is ever unpickled: there is no torch.load here, only safetensors and json. A folder is
first written as `.tmp-ckpt-*` next to its destination, fsync'd and then renamed, so a crash
leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import shutil
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
from qkvlab.fsutil import fsync_dir, fsync_file, sha256_file, write_text_atomic
from qkvlab.model import GPT, ModelConfig
from qkvlab.train import guard
from qkvlab.train.config import RunConfig, read_config_source

FORMAT = "qkvlab-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
BEST_DIR = "best"
# Pruned checkpoints are renamed to .trash-* first (atomic) and deleted after, so a crash
# mid-delete never leaves a half-deleted ckpt-* folder that looks like a checkpoint.
TRASH_PREFIX = ".trash-"
CKPT_RE = re.compile(r"^ckpt-(\d{7,})$")
TIED_KEY = "lm_head.weight"
# Suffixes of files made by torch.save / pickle: named in errors, never opened.
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")
# Optimizer group keys that describe the kernel, not the optimisation: keep the current ones.
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:07d}"


def ckpt_step(path: Path) -> int | None:
    """The step of a `ckpt-NNNNNNN` folder name, else None."""
    m = CKPT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


# ---- RNG states ---------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may touch, as JSON-able data."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` recorded (CUDA states only when the device count matches).

    A malformed state (from a hand-edited or foreign state.json) raises QkvlabError, not
    whatever the setters happen to raise.
    """
    try:
        torch.set_rng_state(_unb64(state["torch"]))
        if "python" in state:
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in state:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                 cached))
        cuda = state.get("cuda")
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError, AttributeError) as exc:
        raise QkvlabError(f"the RNG state of the checkpoint is malformed ({type(exc).__name__}): "
                          "the checkpoint was not written by qkvlab train") from None


# ---- tensors <-> files --------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The plain module behind torch.compile (its state_dict keys carry no `_orig_mod.`)."""
    return getattr(model, "_orig_mod", model)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict on the CPU; a tied head is dropped (safetensors refuses shared tensors)."""
    model = unwrap(model)
    sd = model.state_dict()
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        sd.pop(TIED_KEY, None)
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def optimizer_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors for optimizer.safetensors, JSON-able rest of optimizer.state_dict())."""
    sd = optimizer.state_dict()
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


def write_checkpoint(
    dest: Path,
    model: nn.Module,
    cfg: RunConfig,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint folder at `dest` atomically (replacing an old one there).

    `state` adds fields such as step, tokens and best_val_loss to state.json.
    """
    dest = Path(dest)
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-ckpt-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        files = [MODEL_FILE]
        save_file(model_tensors(model), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        guard.slow_ckpt_pause("model written")  # test hook: lets crash tests kill mid-write
        opt_json = None
        if optimizer is not None:
            opt_tensors, opt_json = optimizer_payload(optimizer)
            save_file(opt_tensors, str(tmp / OPTIM_FILE), metadata={"format": "pt"})
            files.append(OPTIM_FILE)
            guard.slow_ckpt_pause("optimizer written")
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
            "config": cfg.to_dict(),
            "optimizer": opt_json,
            "rng": rng_state(),
        }
        (tmp / STATE_FILE).write_text(
            json.dumps(full, indent=1, default=_json_default) + "\n", encoding="utf-8")
        files.append(STATE_FILE)
        guard.slow_ckpt_pause("state written")
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
        guard.slow_ckpt_pause("manifest written")
        if dest.exists():
            # Rename the old folder aside first: rename() cannot replace a non-empty folder.
            old = parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
            os.replace(dest, old)
            guard.slow_ckpt_pause("old checkpoint renamed aside")
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


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The `ckpt-*` folders of a run, oldest first (not verified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and ckpt_step(p) is not None]
    return sorted(found, key=lambda p: ckpt_step(p) or 0)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write ckpt-{step}, point `latest` at it, and prune all but the newest keep_last."""
    run_dir = Path(run_dir)
    path = write_checkpoint(run_dir / ckpt_name(step), model, cfg, optimizer=optimizer,
                            state={**state, "step": step, "kind": "train"})
    guard.slow_ckpt_pause("checkpoint complete, latest not yet updated")
    try:
        write_text_atomic(run_dir / LATEST_FILE, path.name + "\n")
    except OSError as exc:
        # the new checkpoint is complete; `latest` still names the previous one
        raise CheckpointWriteError(guard.storage_message(
            f"updating {run_dir / LATEST_FILE}", exc, last_good_checkpoint(run_dir))) from exc
    guard.slow_ckpt_pause("latest updated, not yet pruned")
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if old != path:
            _discard(old)
    return path


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
    for p in Path(run_dir).glob(".tmp-ckpt-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(run_dir).glob(f"{TRASH_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)
    for folder in (Path(run_dir), Path(run_dir) / "tokenizer"):
        # temp files of qkvlab.fsutil.write_bytes_atomic (".NAME.xxxx.tmp") cut short by a crash
        for p in folder.glob(".*.tmp"):
            if p.is_file():
                p.unlink(missing_ok=True)
    for p in Path(run_dir).glob(".old-*"):
        # .old-NAME-xxxxxxxx: a crash between the two renames of write_checkpoint leaves the
        # previous NAME here with nothing in its place; put it back rather than lose it
        name = p.name.removeprefix(".old-").rsplit("-", 1)[0]
        target = Path(run_dir) / name
        if name and not target.exists():
            os.replace(p, target)
        else:
            shutil.rmtree(p, ignore_errors=True)


# ---- verification and discovery -----------------------------------------------------------
class CorruptCheckpoint(QkvlabError):
    """A checkpoint folder whose files do not match its manifest."""


class CheckpointWriteError(QkvlabError, OSError):
    """Writing a checkpoint failed (disk full, read-only, ...); the older ones are intact.

    Also an OSError, so code that catches the underlying OSError keeps working.
    """


def _problem(path: Path) -> str | None:
    """What is wrong with a checkpoint folder ("file X: why"), or None if it verifies."""
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return f"file {MANIFEST_FILE}: not a {FORMAT} manifest"
    except FileNotFoundError:
        return f"file {MANIFEST_FILE}: missing"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        return f"file {MANIFEST_FILE}: unreadable ({type(exc).__name__})"
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
        if _problem(other) is None:
            return other
    return None


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest ckpt-* folder of a run that verifies against its manifest, else None."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if _problem(ckpt) is None:
            return ckpt
    return None


def storage_error(exc: OSError, run_dir: Path) -> QkvlabError | None:
    """A one-line error for a full/read-only disk during a run, naming the last good
    checkpoint; None for an OSError that is not about storage (a bug: keep its traceback)."""
    if isinstance(exc, QkvlabError):
        return exc
    if not guard.is_storage_error(exc):
        return None
    what = f"writing {exc.filename}" if getattr(exc, "filename", None) else "writing the run"
    return QkvlabError(guard.storage_message(what, exc, last_good_checkpoint(run_dir), run_dir))


def verify_checkpoint(path: Path) -> None:
    """Raise CorruptCheckpoint naming the bad file and the previous good checkpoint."""
    path = Path(path)
    problem = _problem(path)
    if problem is None:
        return
    prev = _previous_good(path)
    where = (f"the previous good checkpoint is {prev} (delete {path} to resume from it)"
             if prev is not None else "there is no earlier good checkpoint in its run folder")
    raise CorruptCheckpoint(f"checkpoint {path} is corrupt ({problem}); {where}")


def _refuse_pickle(path: Path) -> QkvlabError:
    return QkvlabError(
        f"{path} is a single file, not a qkvlab checkpoint folder; qkvlab never unpickles files "
        "(no torch.load): give a run folder or a ckpt-* folder written by `qkvlab train`"
    )


def is_checkpoint_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file() or (Path(path) / STATE_FILE).is_file()


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
        if _problem(ckpt) is None:
            return ckpt
    if is_checkpoint_dir(path / BEST_DIR):
        return path / BEST_DIR
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    extra = (f" (found {', '.join(pickles)}: pickle files are never loaded)" if pickles else "")
    raise QkvlabError(
        f"no qkvlab checkpoint in {path}{extra}: train with `qkvlab train CONFIG --out {path}` "
        "or give a checkpoint folder"
    )


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


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Find, verify and parse a checkpoint (no tensors are loaded yet)."""
    ckpt = find_checkpoint(path)
    verify_checkpoint(ckpt)
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
    if not _is_int(version):
        raise CorruptCheckpoint(f"checkpoint {ckpt} is corrupt (file {STATE_FILE}: "
                                f"format_version {version!r} is not an integer)")
    if version > FORMAT_VERSION:
        raise QkvlabError(
            f"checkpoint {ckpt} has format version {state['format_version']}, newer than this "
            f"qkvlab reads ({FORMAT_VERSION}): upgrade qkvlab"
        )
    problem = _state_problem(ckpt, state)
    if problem:
        raise CorruptCheckpoint(f"checkpoint {ckpt} is corrupt (file {STATE_FILE}: {problem})")
    try:
        cfg = RunConfig.from_dict(state["config"])
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
    run_file = ckpt.parent / "config.toml"
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _rng_ok(rng: Any) -> bool:
    """Whether `rng` has the shape `rng_state` writes (checked before any setter sees it)."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), str):
        return False
    try:
        if len(base64.b64decode(rng["torch"], validate=True)) != torch.get_rng_state().numel():
            return False
    except ValueError:
        return False
    py, npy = rng.get("python"), rng.get("numpy")
    if py is not None and not (isinstance(py, list) and len(py) == 3 and _is_int(py[0])
                               and isinstance(py[1], list) and len(py[1]) == 625
                               and all(_is_int(v) and 0 <= v < 1 << 32 for v in py[1])
                               and (py[2] is None or _is_number(py[2]))):
        return False
    if npy is not None and not (isinstance(npy, list) and len(npy) == 5 and npy[0] == "MT19937"
                                and isinstance(npy[1], list) and len(npy[1]) == 624
                                and all(_is_int(v) and 0 <= v < 1 << 32 for v in npy[1])
                                and all(_is_int(v) for v in npy[2:4]) and _is_number(npy[4])):
        return False
    cuda = rng.get("cuda")
    return cuda is None or (isinstance(cuda, list) and all(isinstance(c, str) for c in cuda))


def _state_problem(ckpt: Path, state: dict[str, Any]) -> str | None:
    """What is malformed in the fields of state.json that loading reads, or None.

    The manifest proves the files are the ones written; these checks keep a hand-made or
    foreign state.json from reaching int(), comparisons or the RNG setters as junk.
    """
    step = state.get("step", 0)
    if not _is_int(step) or step < 0:
        return f"step {step!r} is not a non-negative integer"
    folder_step = ckpt_step(ckpt)
    if folder_step is not None and step != folder_step:
        return f"step {step} does not match the folder name {ckpt.name}"
    for key in ("best_val_loss", "val_loss", "train_loss"):
        if state.get(key) is not None and not _is_number(state[key]):
            return f"{key} {state[key]!r} is not a number"
    for key in ("skipped_steps", "world_size"):
        if key in state and (not _is_int(state[key]) or state[key] < 0):
            return f"{key} {state[key]!r} is not a non-negative integer"
    for rng in [state.get("rng"), *(state.get("rng_ranks") or [])]:
        if not _rng_ok(rng):
            return "rng is missing or malformed"
    if "rng_ranks" in state and not isinstance(state["rng_ranks"], list):
        return "rng_ranks is malformed"
    opt = state.get("optimizer")
    if opt is not None and not (isinstance(opt, dict)
                                and isinstance(opt.get("param_groups"), list)
                                and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                        for g in opt["param_groups"])
                                and isinstance(opt.get("nontensor_state", {}), dict)):
        return "optimizer is malformed"
    return None


def _load_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        # e.g. a pickle renamed to model.safetensors: safetensors only parses, never executes
        why = " ".join(str(exc).split())[:200]
        raise CorruptCheckpoint(f"checkpoint {path.parent} is corrupt (file {path.name}: not "
                                f"readable {what} safetensors: {why})") from None


def load_model_state(model: nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's weights into `model`, checking names and shapes first."""
    model = unwrap(model)
    tensors = _load_tensors(ckpt.path / MODEL_FILE, "model")
    expected = model.state_dict()
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    wanted = {k: v for k, v in expected.items() if not (tied and k == TIED_KEY)}
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    bad = [f"{k} is {list(tensors[k].shape)} in the checkpoint but {list(v.shape)} in the model"
           for k, v in wanted.items() if k in tensors and tensors[k].shape != v.shape]
    bad += [f"{k} is {str(tensors[k].dtype).removeprefix('torch.')} in the checkpoint but "
            f"{str(v.dtype).removeprefix('torch.')} in the model" for k, v in wanted.items()
            if k in tensors and tensors[k].shape == v.shape
            and (tensors[k].is_floating_point() != v.is_floating_point()
                 or tensors[k].is_complex() != v.is_complex())]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:4])}")
        parts.extend(bad[:4])
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


def load_optimizer_state(optimizer: torch.optim.Optimizer, ckpt: Checkpoint) -> None:
    """Restore AdamW's moments and step counts (bitwise) from optimizer.safetensors."""
    if not ckpt.has_optimizer:
        raise QkvlabError(f"checkpoint {ckpt.path} has no optimizer state (a best/ or converted "
                          "checkpoint): resume from a ckpt-* folder")
    meta = ckpt.state["optimizer"]
    tensors = _load_tensors(ckpt.path / OPTIM_FILE, "optimizer")
    current = optimizer.state_dict()["param_groups"]
    saved = meta["param_groups"]
    if len(saved) != len(current) or any(len(a["params"]) != len(b["params"])
                                         for a, b in zip(saved, current, strict=True)):
        raise QkvlabError(f"checkpoint {ckpt.path} has optimizer state for other parameters: "
                          "resume with the config the run was started with")
    problem = _optimizer_problem(optimizer, current, saved, tensors,
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
    for s, c in zip(saved, current, strict=True):
        g = dict(s)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        for key in _KERNEL_KEYS:
            if key in c:
                g[key] = c[key]
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "flag"
    if _is_number(value):
        return "number"
    if isinstance(value, list | tuple) and all(_is_number(v) for v in value):
        return f"{len(value)} numbers"
    return type(value).__name__


def _optimizer_problem(optimizer: Any, current: list[dict[str, Any]], saved: list[dict[str, Any]],
                       tensors: dict[str, torch.Tensor], nontensor: Any) -> str | None:
    """What in a saved optimizer state would crash or corrupt AdamW later, or None.

    Checked before anything is loaded: the parameter indices of each group, the kind of each
    hyperparameter (a string lr would only fail at the first step), the tensor names, and the
    moments' shapes against the parameters (load_state_dict does not compare shapes).
    """
    for s, c in zip(saved, current, strict=True):
        if s["params"] != c["params"]:
            return "parameter indices differ from this model's"
        for key, value in c.items():
            if key == "params" or key in _KERNEL_KEYS or key not in s:
                continue
            if value is not None and _kind(s[key]) != _kind(value):
                return f"hyperparameter {key} is {s[key]!r}"
            if _kind(value) == "number" and not math.isfinite(s[key]):
                return f"hyperparameter {key} is {s[key]!r}"
    indices = [i for c in current for i in c["params"]]
    live = getattr(optimizer, "param_groups", None)  # absent on a stand-in (FSDP's capture)
    params = [p for g in live for p in g["params"]] if live is not None else None
    for key, value in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() \
                or int(parts[1]) not in indices:
            return f"unexpected tensor {key!r}"
        idx, name = int(parts[1]), parts[2]
        if not value.is_floating_point():
            return f"{key} is {value.dtype}, not floating point"
        if params is not None and idx < len(params):
            want = () if name == "step" else tuple(params[idx].shape)
            if name in (*_MOMENTS, "step") and tuple(value.shape) != want:
                return f"{key} has shape {list(value.shape)}, the parameter {list(want)}"
    if not isinstance(nontensor, dict):
        return "nontensor_state is malformed"
    for idx, rest in nontensor.items():
        if not (isinstance(idx, str) and idx.isdigit() and int(idx) in indices) \
                or not isinstance(rest, dict) or not all(_kind(v) in ("flag", "number")
                                                          for v in rest.values()):
            return f"nontensor_state entry {idx!r} is malformed"
    return None


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Checkpoint]:
    """(model in eval mode on `device`, checkpoint) from a run folder or checkpoint folder."""
    ckpt = read_checkpoint(path)
    model = GPT(ckpt.config.model)
    load_model_state(model, ckpt)
    model.to(device)
    model.eval()
    return model, ckpt
