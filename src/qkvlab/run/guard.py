"""Guards for long runs: resource sanity checks, storage errors, non-finite weights.

Three small concerns that the trainer, the checkpoint writer and the commands share:

* `check_bytes` / `train_memory_check` / `model_memory_check` refuse absurd configs (a
  4-trillion-parameter model, a batch of a billion windows) with a one-line `QkvlabError`
  *before* anything is allocated or written, instead of dying later in the out-of-memory killer.
  The estimates are strict lower bounds (weights, gradients, AdamW moments, logits), so they
  never refuse a run that could have fitted.
* `storage_error` turns the OSErrors of a full or read-only disk into a one-line `QkvlabError`
  that says what was being written and which checkpoint is still good.
* `weights_finite` tells whether a model's weights may be saved as a checkpoint: one with a
  NaN or inf could be neither resumed nor evaluated.

(The crash-test hook of checkpoint writes is run/checkpoint.py's `on_write_stage`.)
"""

from __future__ import annotations

import errno
import os
import re

import torch

from qkvlab.errors import QkvlabError
from qkvlab.model.config import ModelConfig
from qkvlab.model.params import count_params

GIB = 1 << 30
# errno -> what the user is told; these are problems of the machine, not bugs of qkvlab
STORAGE_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "the file is too large for the file system",
    errno.EIO: "an I/O error occurred",
}
_OS_ERROR_RE = re.compile(r"os error (\d+)")


# ---- storage errors -----------------------------------------------------------------------
def os_errno(exc: BaseException) -> int | None:
    """The errno of an OSError, or of a safetensors error that wraps one ("os error 28")."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    m = _OS_ERROR_RE.search(str(exc))
    return int(m.group(1)) if m else None


def is_storage_error(exc: BaseException) -> bool:
    return os_errno(exc) in STORAGE_ERRNOS


def describe_os_error(exc: BaseException) -> str:
    """A short reason: "the disk is full (No space left on device)" or the error's text."""
    code = os_errno(exc)
    if code in STORAGE_ERRNOS:
        return f"{STORAGE_ERRNOS[code]} ({os.strerror(code)})"
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return " ".join(text.split()) or type(exc).__name__  # one line, whatever the library wrote


def storage_message(doing: str, exc: BaseException, last_good: os.PathLike | str | None,
                    run_dir: os.PathLike | str | None = None) -> str:
    """One line: what failed, why, that the last good checkpoint is intact, how to go on."""
    where = (f"the last good checkpoint {last_good} is intact" if last_good is not None
             else "no other checkpoint was touched")
    code = os_errno(exc)
    fix = ("free some space" if code in (errno.ENOSPC, errno.EDQUOT)
           else "give this user write permission there" if code in (errno.EACCES, errno.EPERM)
           else "fix the disk")
    resume = f", then resume with `qkvlab train {run_dir} --resume`" if run_dir else ""
    return f"{doing} failed: {describe_os_error(exc)}; {where}: {fix}{resume}"


# ---- non-finite weights -------------------------------------------------------------------
def weights_finite(model: torch.nn.Module) -> bool:
    """True when every floating-point parameter and buffer this process holds is finite.

    Under FSDP each process checks its own shards (`to_local`); one device sync in all.
    """
    flags = []
    for t in (*model.parameters(), *model.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_floating_point() and local.numel():
            flags.append(torch.isfinite(local.detach()).all())
    return bool(torch.stack(flags).all()) if flags else True


def divergence_message(run_dir: os.PathLike | str, streak: int, step: int,
                       last_good: os.PathLike | str | None, lr: float, min_lr: float,
                       dtype: str) -> str:
    """One line for a run stopped after `streak` non-finite steps, the last logged as `step`.

    A resume replays the same steps from the same checkpoint (and refuses a changed
    optim.lr), so the advice is a fresh run with the exact command; fp32 is suggested only
    to a run that is not in fp32 already.
    """
    where = (f"the last good checkpoint is {last_good}" if last_good is not None
             else "no checkpoint with good weights was kept")
    new_lr = float(f"{lr / 10:.3g}")
    sets = f"--set optim.lr={new_lr:g}"
    if min_lr > 0:
        sets += f" --set optim.min_lr={min(float(f'{min_lr / 10:.3g}'), new_lr):g}"
    fix = (f"lower optim.lr in a fresh run: `qkvlab train {run_dir} {sets} --out "
           f"{run_dir}-lr{new_lr:g}` (a resume would repeat the divergence)")
    if dtype != "fp32":
        fix += ", or add `--set train.dtype=fp32` to it"
    return (f"training diverged: non-finite loss or gradient for {streak} consecutive steps "
            f"(the last at step {step}); {where}: {fix}")


# ---- memory sanity ------------------------------------------------------------------------
def host_memory() -> int | None:
    """Physical memory of this machine in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def device_memory(device: torch.device) -> int | None:
    """Total memory of `device` in bytes: the GPU's for CUDA, the machine's otherwise."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.get_device_properties(device).total_memory)
        except (RuntimeError, AssertionError, ValueError):
            return None
    return host_memory()


def check_bytes(what: str, need: int, have: int | None, where: str, fix: str) -> None:
    """Refuse when a strict lower bound `need` already exceeds the `have` bytes of `where`."""
    if have is not None and need > have:
        raise QkvlabError(f"{what} needs at least {need / GIB:,.1f} GiB but {where} has "
                          f"{have / GIB:,.1f} GiB: {fix}")


def _params(model: ModelConfig) -> int:
    return count_params(model).total


def model_memory_check(model: ModelConfig, what: str = "the model") -> None:
    """Refuse a model whose fp32 weights alone exceed this machine's memory."""
    params = _params(model)
    check_bytes(f"{what} ({params:,} parameters in fp32)", 4 * params, host_memory(),
                "this machine", "check the model sizes (n_layer, n_embd, vocab_size, ...)")


def train_memory_check(cfg, device: torch.device) -> None:
    """Refuse a run whose weights + gradients + AdamW moments + logits cannot fit the device,
    or whose fixed validation windows cannot fit the machine. `cfg` is a RunConfig."""
    m, t = cfg.model, cfg.train
    params = _params(m)
    logit_bytes = 2 if t.dtype == "bf16" else 4
    need = 16 * params + t.batch_size * m.block_size * m.vocab_size * logit_bytes
    where = f"the {device.type} device" if device.type == "cuda" else "this machine"
    check_bytes(f"training ({params:,} parameters, batch {t.batch_size} x {m.block_size})",
                need, device_memory(device), where,
                "reduce the model sizes or train.batch_size (use train.grad_accum instead)")
    # x and y of every val window are int64 and live on the host for the whole run
    windows = 16 * t.eval_windows * (m.block_size + 1)
    check_bytes(f"{t.eval_windows:,} validation windows of {m.block_size} tokens", windows,
                host_memory(), "this machine", "reduce train.eval_windows")
