"""Weights & Biases logging (`train.wandb = true`): TensorBoard's scalars, the config, the name.

The trainer writes each scalar to TensorBoard and to a WandbLog under the same tag and step
(train/steps.py `log_scalar`); only rank 0 opens either. The W&B run is named after the run
folder and holds the resolved config. W&B is an optional extra and never stands in training's
way: without the package, or when wandb.init fails or times out, one warning line is printed
and the run trains on without it; a failing log call turns W&B off for the rest of the session,
also with one warning. Without WANDB_MODE and without an API key it logs offline (never a login
prompt); `wandb sync RUN/wandb/offline-run-*` uploads such a run later.

W&B's files go under RUN/wandb/, and RUN/wandb-run.json keeps the W&B run's id: a session
resumed from a checkpoint logs into the same W&B run (`id=..., resume="allow"`), from the step
after the checkpoint, as metrics.jsonl does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.fsutil import write_text_atomic
from qkvlab.jsonfile import read_json_object
from qkvlab.run.config import RunConfig
from qkvlab.run.layout import WANDB_DIR, WANDB_RUN_FILE

INIT_TIMEOUT_S = 20.0  # wandb.init gives up after this (its default: 90 s)
# run.finish waits this long for uploads; what is left stays in RUN/wandb for `wandb sync`
FINISH_TIMEOUT_S = 120.0
SYNC_HINT = "`wandb sync RUN/wandb/offline-run-*` uploads it later"


def warn(msg: str) -> None:
    """One warning line on stderr, even in a quiet session: W&B was asked for and is off."""
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def _why(exc: BaseException) -> str:
    """An exception in one short line (wandb's messages can span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class WandbLog:
    """A W&B run that takes scalars as TensorBoard's SummaryWriter does (add_scalar, close)."""

    def __init__(self, run: Any, run_dir: Path):
        self.run = run
        self.run_dir = run_dir
        self.ok = True  # False after a failed log call: nothing more is sent

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.run is None or not self.ok:
            return
        try:
            # a resumed online run continues at the server's last step + 1: wandb would drop
            # the steps before that a resume logs again, with a warning each
            if step >= self.run.step:
                self.run.log({tag: value}, step=step)
        except Exception as exc:  # wandb raises its own classes; none may stop training
            # finished at close, not now: finishing may wait for uploads (FINISH_TIMEOUT_S)
            self.ok = False
            warn(f"W&B logging failed ({_why(exc)}): training goes on without it")

    def close(self, failed: bool = False) -> None:
        """Finish the W&B run, marked failed when the session ended with an exception or a log
        call failed."""
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish(exit_code=1 if failed or not self.ok else 0)
        except Exception as exc:
            if self.ok:  # one warning a session
                warn(f"W&B did not finish cleanly ({_why(exc)}): its files are in "
                     f"{self.run_dir / WANDB_DIR}")


def open_wandb(cfg: RunConfig, run_dir: Path, resumed: bool, quiet: bool,
               say: Callable[[str], None]) -> WandbLog | None:
    """The W&B run of this session (the run folder's own one when `resumed` from a checkpoint),
    or None, after one warning, when W&B cannot start."""
    try:
        # optional dependency (the wandb extra): imported only when train.wandb is on
        import wandb
    except Exception as exc:  # not installed, or a broken install (not always ImportError)
        warn(f"train.wandb is on but wandb cannot be imported ({_why(exc)}; pip install "
             "'qkvlab[wandb]'): training without W&B")
        return None
    try:
        run = wandb.init(**init_kwargs(wandb, cfg, run_dir, resumed, quiet, say))
    except Exception as exc:
        warn(f"W&B did not start ({_why(exc)}): training without it")
        return None
    finally:
        drop_outside_links(run_dir)  # a failed init leaves its run folder (and link) too
    try:
        save_run_id(run_dir, run.id, cfg)
    except OSError as exc:
        warn(f"{run_dir / WANDB_RUN_FILE} not written ({_why(exc)}): a resume would log to a "
             "new W&B run")
    return WandbLog(run, run_dir)


def init_kwargs(wandb: Any, cfg: RunConfig, run_dir: Path, resumed: bool, quiet: bool,
                say: Callable[[str], None]) -> dict[str, Any]:
    """wandb.init's arguments for this session."""
    tc = cfg.train
    kwargs: dict[str, Any] = {
        "project": tc.wandb_project, "entity": tc.wandb_entity,
        "name": run_dir.resolve().name, "dir": str(run_dir),
        "config": dataclasses.replace(cfg, out_dir=str(run_dir)).to_dict(),  # as config.toml
        "settings": settings(wandb, quiet),
    }
    run_id = saved_run_id(run_dir) if resumed else None
    if run_id:
        kwargs.update(id=run_id, resume="allow")
    if not os.environ.get("WANDB_MODE") and not has_credentials(wandb):
        kwargs["mode"] = "offline"  # without a key online mode asks for one, or fails
        say(f"W&B: no API key configured, logging offline to {run_dir / WANDB_DIR}; {SYNC_HINT}")
    return kwargs


def settings(wandb: Any, quiet: bool) -> Any:
    """The wandb.Settings of a session: short waits, the terminal left alone."""
    init = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT_S}
    return wandb.Settings(
        **init,  # W&B's own variable, when set, wins: a slow link may need longer
        finish_timeout=FINISH_TIMEOUT_S,
        console="off",  # stdout and stderr stay the trainer's own (the progress bar)
        reinit="create_new",  # a run of its own, even beside one the caller has open
        silent=quiet)


def has_credentials(wandb: Any) -> bool:
    """Whether W&B has an API key (or identity token), never asking for one."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True  # wandb.login would also look the user up: seconds without a network
    return wandb.login(prompt=False, verify=False)  # its settings files and netrc


def saved_run_id(run_dir: Path) -> str | None:
    """The W&B run id kept in RUN/wandb-run.json (None: none kept, or a damaged file)."""
    path = run_dir / WANDB_RUN_FILE
    if not path.is_file():
        return None
    try:
        data = read_json_object(path, {"id": "str"}, fix="this session logs to a new W&B run")
    except QkvlabError as exc:
        warn(str(exc))
        return None
    return data.get("id") or None


def save_run_id(run_dir: Path, run_id: str, cfg: RunConfig) -> None:
    record = {"id": run_id, "project": cfg.train.wandb_project, "entity": cfg.train.wandb_entity}
    write_text_atomic(run_dir / WANDB_RUN_FILE, json.dumps(record, indent=1) + "\n")


def drop_outside_links(run_dir: Path) -> None:
    """Remove the links under RUN/wandb that lead out of the run folder (never their targets).
    wandb-core links each session's logs/debug-core.log to its own log in ~/.cache/wandb, and
    the trainer refuses a run folder with a link out of it (fsutil.check_tree): the next resume
    would be refused. Best effort: a link that cannot be removed is left to that check."""
    top = run_dir / WANDB_DIR
    try:
        if top.is_symlink() or not top.is_dir():  # a linked one is not W&B's: not ours to tidy
            return
        root = run_dir.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a link loop; check_tree says what is wrong
        return
    for dirpath, dirnames, filenames in os.walk(top):  # never into a linked folder
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: a link loop
                if path.is_symlink() and not path.resolve().is_relative_to(root):
                    path.unlink()
