"""`qkvlab sweep SPEC`: train a spec's grid of variants x seeds, one folder per run.

This module is the machinery; the command's steps and options are in
qkvlab.commands.sweep.

The sweep is a loop over `train(cfg, resume=True)`, seed-major (seed 1 of every variant first,
so a partial sweep is already a complete comparison at one seed). Everything that can be
checked is checked before the first step: the spec, every variant's config, the data (prepared
or preparable), vocabularies, the objective, the folder's record of which spec made it, and
the config of every run folder that already exists.

Re-running the same command continues: finished runs are skipped, interrupted ones resume from
their latest checkpoint (exactly, see train/trainer.py), runs that failed (diverged) are
skipped unless --retry-failed. `--reuse OTHER_SWEEP` copies the finished runs of another sweep
that have the same trajectory-deciding config and seed instead of training them again. The
folder layout::

    <out>/sweep.json                 spec name, fingerprints, the commands and machines
    <out>/spec.toml                  the spec, as data (its `set` ends with the --set overrides)
    <out>/<group>/seed-<n>/          a run folder (config.toml, metrics.jsonl, summary.json, ...)

Scale: `--launcher "torchrun --standalone --nproc-per-node=8"` starts each run as a subprocess
`LAUNCHER -m qkvlab train RUN_DIR --resume` (still one run after another), and
`--print-commands` prints one such self-contained command per pending run for a scheduler
(a SLURM array, GNU parallel) instead of running anything. `--jobs N` trains N runs at once
as subprocesses, the machine's cores split between them (each run's output in its folder's
train.log): on 2 CPU cores two single-threaded runs train 11% more tokens per second than one
two-threaded run (docs/experiments.md). qkvlab.experiments.executor trains the runs, in each
of these ways with one policy for signals and failures.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from qkvlab import __version__
from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import (
    SPEC_COPY,
    Group,
    Run,
    Spec,
    config_identity,
    identity_diff,
)
from qkvlab.fsutil import check_tree, write_text_atomic
from qkvlab.model.params import count_params
from qkvlab.run.config import (
    EMBEDDED_SOURCE,
    REUSE_HARMLESS,
    as_recorded,
    config_diff,
    load_config,
    save_config,
)
from qkvlab.run.layout import (
    CONFIG_FILE,
    FAILED_FILE,
    REUSED_FILE,
    SUMMARY_FILE,
    ckpt_step,
    list_checkpoints,
)
from qkvlab.run.load import open_data
from qkvlab.run.lock import lock_holder
from qkvlab.run.machine import cpu_model
from qkvlab.run.records import is_finished, read_json_record
from qkvlab.train import objectives

SWEEP_FILE = "sweep.json"
MAX_RUNS_WITHOUT_YES = 100  # more runs than this to launch needs --yes
MAX_SESSIONS = 100  # sessions kept in sweep.json


# ---- the state of one run -----------------------------------------------------------------
@dataclass(frozen=True)
class RunState:
    """done (summary at max_steps), running (a live process holds the folder's lock; `note`
    names it), failed (failed.json), partial (checkpoints), pending."""

    status: str
    step: int = 0
    final_val_loss: float | None = None
    note: str = ""


def run_state(run: Run) -> RunState:
    run_dir = run.run_dir
    summary = read_json_record(run_dir / SUMMARY_FILE)
    max_steps = run.config.steps
    if is_finished(summary, max_steps):
        return RunState("done", int(summary["steps"]), summary.get("final_val_loss"))
    failed = read_json_record(run_dir / FAILED_FILE)
    ckpts = list_checkpoints(run_dir)
    step = (ckpt_step(ckpts[-1]) or 0) if ckpts else 0
    holder = lock_holder(run_dir)
    if holder:  # another sweep (or a plain `qkvlab train`) is training it now
        return RunState("running", step, None, holder)
    if failed:
        return RunState("failed", step, None, str(failed.get("error", "")))
    if ckpts:
        return RunState("partial", step)
    return RunState("pending")


def claimed_elsewhere(run: Run) -> str | None:
    """Why a run that was to train must not start now, or None: another process trains it, or
    has finished it since the sweep began (two sweeps sharing one folder)."""
    state = run_state(run)
    if state.status == "running":
        return f"trained by {state.note} now"
    if state.status == "done":
        return "finished meanwhile"
    return None


# ---- machine and command records ----------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What a result depends on: CPU, accelerators, library versions (no host names)."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "qkvlab": __version__,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


# ---- checks before anything is trained -----------------------------------------------------
def check_sweep_dir(out: Path, spec: Spec, groups: list[Group]) -> dict[str, Any]:
    """The folder's record, merged with this spec's groups; refuses a folder of another spec."""
    path = out / SWEEP_FILE
    if path.is_file():
        record = read_json_record(path)
        if record is None or not isinstance(record.get("groups"), dict):
            raise QkvlabError(f"{path} is unreadable: it is not a sweep record (move it away "
                              "or choose another --out)")
        if record.get("spec") != spec.name:
            raise QkvlabError(f"{out} holds the sweep of spec {record.get('spec')!r}, not "
                              f"{spec.name!r}: choose another --out")
        for g in groups:
            old = record["groups"].get(g.name)
            if old is None or old.get("fingerprint") == g.fingerprint:
                continue
            diff = identity_diff(old.get("identity", {}), g.identity)
            if diff:
                again = "" if spec.sweep_dir is not None else (
                    f", or continue it with the spec and --set it was made with (qkvlab sweep "
                    f"{out})")
                raise QkvlabError(
                    f"{out} was made by a different version of spec {spec.name}: variant "
                    f"{g.name} differs at {'; '.join(diff[:4])}: choose another --out (or "
                    f"restore the spec){again}")
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise QkvlabError(f"{out} exists and is not a sweep folder (no {SWEEP_FILE}): "
                              "choose another --out")
        record = {"format": 1, "spec": spec.name, "created": now_iso(), "groups": {},
                  "sessions": []}
    for g in groups:
        record["groups"][g.name] = {
            "fingerprint": g.fingerprint, "variant": g.variant, "family": g.family,
            "point": g.point, "baseline": g.baseline, "identity": g.identity,
        }
    record["fingerprint"] = spec.fingerprint(groups)
    return record


def write_sweep_record(out: Path, record: dict[str, Any], spec: Spec) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / SPEC_COPY, f"# spec {spec.name}, as resolved by qkvlab sweep from "
                                       f"{spec.source}\n" + spec.to_toml())
    write_text_atomic(out / SWEEP_FILE, json.dumps(record, indent=1) + "\n")


def check_run_dirs(runs: list[Run]) -> None:
    """A run folder that exists must hold this run: same trajectory-deciding config, same seed;
    a finished one also the same length and evaluations (REUSE_HARMLESS), or its results would
    be taken for this sweep's."""
    for run in runs:
        path = run.run_dir / CONFIG_FILE
        if not path.is_file():
            continue
        try:
            saved = load_config(path)
        except QkvlabError as exc:
            raise QkvlabError(f"run folder {run.run_dir} has a config qkvlab rejects ({exc}): "
                              "move the folder away or choose another --out") from None
        diff = identity_diff(config_identity(saved), config_identity(run.config))
        if saved.train.seed != run.seed:
            diff.insert(0, f"train.seed ({saved.train.seed} -> {run.seed})")
        if diff:
            raise QkvlabError(f"run folder {run.run_dir} was trained with another config "
                              f"({'; '.join(diff[:4])}): it is not this spec's run; move it away "
                              "or choose another --out")
        if is_finished(read_json_record(run.run_dir / SUMMARY_FILE), run.config.steps):
            diffs = config_diff(saved, run.config, REUSE_HARMLESS)
            if diffs:
                raise QkvlabError(
                    f"run folder {run.run_dir} finished with another config than this sweep asks "
                    f"for, at {'; '.join(diffs[:4])}: choose another --out, or move the folder "
                    "away to train the run again")


def _data_vocab(data_dir: Path) -> tuple[int, str] | None:
    meta = read_json_record(data_dir / "meta.json")
    if meta is None:
        return None
    try:
        return int(meta["vocab_size"]), str(meta["tokenizer"])
    except (KeyError, TypeError, ValueError):
        raise QkvlabError(f"{data_dir / 'meta.json'} is malformed: re-run `qkvlab prepare` for "
                          f"{data_dir} (with --force)") from None


def preflight_data(runs: list[Run], prepare: bool, say) -> list[str]:
    """Check every run's data (and prepare the embedded corpus when `prepare`).

    Returns notes for the dry run (what would be prepared). Refusals are QkvlabErrors naming
    the `qkvlab prepare` command, raised before any run starts.
    """
    notes: list[str] = []
    checked: dict[str, tuple[int, str] | None] = {}
    for run in runs:
        dc = run.config.data
        if dc.dir not in checked:
            data_dir = Path(dc.dir)
            found = _data_vocab(data_dir)
            if found is None:
                if not (dc.prepare_if_missing and dc.source == EMBEDDED_SOURCE):
                    problem = (f"no prepared data at {data_dir} (variant {run.group.name}): run "
                               f"`{dc.prepare_hint()}` first")
                    if prepare:
                        raise QkvlabError(problem)
                    notes.append(f"[red]missing data[/]: {problem}")
                    checked[dc.dir] = None
                    continue
                if prepare:
                    open_data(dc, say)
                    found = _data_vocab(data_dir)
                else:
                    notes.append(f"{data_dir}: not prepared yet; the sweep prepares it "
                                 f"({dc.source}, {dc.tokenizer} tokenizer)")
            checked[dc.dir] = found
        found = checked[dc.dir]
        if found is None:
            continue
        vocab, tokenizer = found
        if tokenizer != dc.tokenizer:
            raise QkvlabError(f"data dir {dc.dir} was prepared with tokenizer {tokenizer} but "
                              f"variant {run.group.name} says data.tokenizer = {dc.tokenizer}")
        model_vocab = run.config.model.vocab_size
        if model_vocab < vocab:
            raise QkvlabError(f"variant {run.group.name}: model.vocab_size = {model_vocab} is "
                              f"smaller than the vocabulary of {dc.dir} ({vocab}): add "
                              f"\"model.vocab_size={vocab}\" to the spec's set")
        objectives.check_objective(run.config, vocab)
    return notes


# ---- tables --------------------------------------------------------------------------------
def _cell(state: RunState, max_steps: int) -> str:
    if state.status == "done":
        loss = state.final_val_loss
        return f"done {loss:.4f}" if loss is not None else "done"
    if state.status == "partial":
        return f"step {state.step}/{max_steps}"
    if state.status == "running":
        return f"running (step {state.step}/{max_steps})"
    if state.status == "failed":
        return "[red]failed[/]"
    return "pending"


def progress_table(spec: Spec, runs: list[Run], states: dict[Path, RunState],
                   title: str) -> Table:
    seeds = list(dict.fromkeys(r.seed for r in runs))
    table = Table(title=title)
    table.add_column("variant")
    for s in seeds:
        table.add_column(f"seed {s}", justify="right")
    by_group: dict[str, dict[int, Run]] = {}
    for r in runs:
        by_group.setdefault(r.group.name, {})[r.seed] = r
    for name, row in by_group.items():
        cells = []
        for s in seeds:
            r = row.get(s)
            cells.append(_cell(states[r.run_dir], r.config.steps) if r else "")
        table.add_row(name + (" *" if next(iter(row.values())).group.baseline else ""), *cells)
    table.caption = "* the baseline"
    return table


def finished_speed(runs: list[Run], states: dict[Path, RunState]) -> float | None:
    """FLOP/s the finished runs of this sweep achieved (median), for time estimates."""
    rates = []
    for r in runs:
        if states[r.run_dir].status == "done":
            s = read_json_record(r.run_dir / SUMMARY_FILE) or {}
            if s.get("tokens_per_s") and s.get("flops_per_token"):
                rates.append(float(s["tokens_per_s"]) * float(s["flops_per_token"]))
    rates.sort()
    return rates[len(rates) // 2] if rates else None


def plan_table(spec: Spec, runs: list[Run], states: dict[Path, RunState]) -> Table:
    table = Table(title=f"spec {spec.name}: {len(runs)} runs "
                        f"({len({r.group.name for r in runs})} variants x "
                        f"{len({r.seed for r in runs})} seeds)")
    for col in ("variant", "projection", "d", "MLP", "scale", "wd", "lr", "non-emb params",
                "total params", "steps", "tokens/run", "PFLOP/run", "seeds: status"):
        table.add_column(col, justify="left" if col in ("variant", "projection",
                                                        "seeds: status") else "right")
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group.name, []).append(r)
    for name, rs in groups.items():
        cfg = rs[0].config
        m = cfg.model
        counts = count_params(m)
        tokens = cfg.steps * cfg.tokens_per_step  # the steps a flop budget pays for, if one
        pflop = cfg.train_flops / 1e15
        counts_by_status: dict[str, int] = {}
        for r in rs:
            st = states[r.run_dir].status
            counts_by_status[st] = counts_by_status.get(st, 0) + 1
        status = ", ".join(f"{n} {st}" for st, n in counts_by_status.items())
        table.add_row(name + (" *" if rs[0].group.baseline else ""), m.projection,
                      str(m.n_embd), str(m.hidden), f"{m.scale:.4g}",
                      f"{cfg.optim.weight_decay:.4g}", f"{cfg.optim.lr:.3g}",
                      f"{counts.non_embedding:,}", f"{counts.total:,}", f"{cfg.steps:,}",
                      f"{tokens:,}",
                      f"{pflop:.3g}", status)
    table.caption = "* the baseline of the paired comparisons"
    return table


def remaining_work(runs: list[Run], states: dict[Path, RunState]) -> tuple[int, float]:
    """(tokens, FLOPs) still to train over the runs that are not done."""
    tokens, flops = 0, 0.0
    for r in runs:
        st = states[r.run_dir]
        if st.status == "done":
            continue
        left_steps = max(r.config.steps - st.step, 0)
        tokens += left_steps * r.config.tokens_per_step
        flops += left_steps * r.config.flops_per_step
    return tokens, flops


# ---- starting runs -------------------------------------------------------------------------
def train_command_for(run: Run, launcher: str | None) -> list[str]:
    """The self-contained command that trains (or resumes) one run from its folder."""
    tail = ["train", str(run.run_dir.resolve()), "--resume"]
    if launcher:
        return [*shlex.split(launcher), "-m", "qkvlab", *tail]
    return ["qkvlab", *tail]


def materialize(run: Run) -> None:
    """Write the run's config.toml, so `qkvlab train RUN_DIR --resume` can start it."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    save_config(as_recorded(run.config), run.run_dir / CONFIG_FILE)


# ---- finished runs of another sweep -------------------------------------------------------
def find_reusable(runs: list[Run], states: dict[Path, RunState],
                  sources: list[str]) -> dict[Path, Path]:
    """For each run not begun here, a finished run with the same trajectory-deciding config and
    seed in one of the `sources` sweep folders (e.g. cpu-nonlinear-q's baseline is cpu-paper's),
    keyed by this run's folder."""
    if not sources:
        return {}
    def key(cfg: Any, seed: int) -> str:
        return json.dumps([config_identity(cfg), seed], sort_keys=True)

    finished: dict[str, list[tuple[Any, Path]]] = {}
    for source in sources:
        src = Path(source)
        if not (src / SWEEP_FILE).is_file():
            raise QkvlabError(f"--reuse {src}: not a sweep folder (no {SWEEP_FILE}); name the "
                              "folder `qkvlab sweep` wrote")
        for cfg_path in sorted(src.glob(f"*/seed-*/{CONFIG_FILE}")):
            try:
                cfg = load_config(cfg_path)
            except QkvlabError:
                continue  # not a run this qkvlab can read: nothing to reuse
            if is_finished(read_json_record(cfg_path.parent / SUMMARY_FILE),
                           cfg.steps):
                finished.setdefault(key(cfg, cfg.train.seed), []).append((cfg, cfg_path.parent))
    found = {}
    for run in runs:
        if states[run.run_dir].status != "pending" or run.run_dir.exists():
            continue
        # the same trajectory is not enough: the copy must have this run's length and
        # evaluations, or its results would be taken for this run's
        same = [path for cfg, path in finished.get(key(run.config, run.seed), [])
                if not config_diff(cfg, run.config, REUSE_HARMLESS)]
        if same:
            found[run.run_dir] = same[0]
    return found


def copy_finished_run(run: Run, src: Path) -> None:
    """Copy a finished run into this sweep (checkpoints too, so --per-window can score it), under
    this run's name and folder; `reused.json` says where it came from."""
    check_tree(src)  # copytree would copy what a link out of the run points to
    tmp = run.run_dir.with_name(f".{run.run_dir.name}.copying")  # not a seed-* folder
    shutil.rmtree(tmp, ignore_errors=True)  # a copy cut short earlier
    shutil.copytree(src, tmp)
    (tmp / FAILED_FILE).unlink(missing_ok=True)
    (tmp / REUSED_FILE).unlink(missing_ok=True)
    os.replace(tmp, run.run_dir)
    materialize(run)  # this sweep's run name and out_dir in config.toml
    write_text_atomic(run.run_dir / REUSED_FILE, json.dumps(
        {"from": reused_name(src), "copied": now_iso()}, indent=1) + "\n")


def reused_name(src: Path) -> str:
    """Where a reused run came from, as `<sweep>/<group>/seed-<n>`: its place among sweeps,
    not a path of the machine that copied it."""
    return "/".join(src.resolve().parts[-3:])


def record_failure(run: Run, error: str) -> None:
    """failed.json: the run is skipped by later sweeps unless --retry-failed."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run.run_dir / FAILED_FILE, json.dumps({
        "error": error, "diverged": "diverged" in error, "time": now_iso(),
    }, indent=1) + "\n")
