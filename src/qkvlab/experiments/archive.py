"""`qkvlab archive SWEEP DEST`: a sweep's records without its checkpoints, small enough to commit.

A finished CPU sweep is gigabytes of checkpoints but only a few hundred KB of records: the
sweep's own files and each run's config, metrics, summary and (after `qkvlab report
--per-window`) its per-window losses. `qkvlab report DEST --per-window` gives the same report
from the copy, and `qkvlab sweep DEST` sees its finished runs as done. With `finished_only`
(`--finished`) a sweep still training is archived without its unfinished runs, so a grid that
takes days can commit each run's records as it completes. Each finished run's attention
statistics (`qkvlab report --attention`) are measured from its final checkpoint first and go
with its records: without checkpoints the archive could not measure them later. Into an archive
of the same spec (runs of one grid trained on two machines, say) the sweep record is merged: the
groups of both, and every session of both, so the archive keeps how each of its runs was
launched, and the spec copy of whichever was launched last (a sweep begun under an older spec
and archived later does not bring that spec back). A run that `qkvlab sweep --reuse DEST` copied
from the archive itself is not copied back: the archive holds it already.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.experiments.runs import ATTENTION_FILE, WINDOW_FILE, attention_record
from qkvlab.experiments.sweep import SWEEP_FILE
from qkvlab.fsutil import check_inside, portable_command, write_text_atomic
from qkvlab.run.config import RunConfig, load_config
from qkvlab.run.layout import CONFIG_FILE, FAILED_FILE, METRICS_FILE, REUSED_FILE, SUMMARY_FILE
from qkvlab.run.records import is_finished, read_json_record

SPEC_FILE = "spec.toml"
SWEEP_RECORDS = (SWEEP_FILE, SPEC_FILE)
RUN_RECORDS = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, FAILED_FILE, WINDOW_FILE,
               ATTENTION_FILE, REUSED_FILE)


def archive_sweep(src: Path, dest: Path, finished_only: bool = False,
                  attention: bool = True) -> tuple[int, int]:
    """Copy the records of sweep folder `src` into `dest`: (runs copied, unfinished runs left
    out; 0 without `finished_only`). With `attention`, each finished run's attention record is
    measured first where its final checkpoint is there and the record is not."""
    if not (src / SWEEP_FILE).is_file():
        raise QkvlabError(f"{src} is not a sweep folder (no {SWEEP_FILE}): pass the folder "
                          "`qkvlab sweep` wrote")
    _check_destination(src, dest)
    merged = _merged_record(src, dest)
    older = merged is not None and _last_launch(src) < _last_launch(dest)
    if older:  # the fingerprint goes with the spec copy it describes
        merged["fingerprint"] = (read_json_record(dest / SWEEP_FILE) or {}).get("fingerprint")
    runs = sorted(p.parent for p in src.glob(f"*/seed-*/{CONFIG_FILE}"))  # every run has one
    finished = {r: cfg for r in runs if (cfg := _finished_config(r))}
    kept = [r for r in (list(finished) if finished_only else runs)
            if not _copied_from(dest, r, src)]
    left = len(runs) - len(finished) if finished_only else 0
    if attention:  # before any copy, so a run whose data is gone stops the archive unwritten
        for run, cfg in finished.items():
            attention_record(run, cfg.steps, cfg)
    copies = [(src / name, dest / name) for name in SWEEP_RECORDS if (src / name).is_file()
              and not (older and name == SPEC_FILE)]
    copies += [(run / name, dest / run.relative_to(src) / name)
               for run in kept for name in RUN_RECORDS if (run / name).is_file()]
    for record, copy in copies:  # all checked before the first copy
        check_inside(src, record)
        check_inside(dest, copy)
    for record, copy in copies:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(record, copy)
    if merged is not None:
        write_text_atomic(dest / SWEEP_FILE, json.dumps(merged, indent=1) + "\n")
    make_portable(dest)
    return len(kept), left


def make_portable(archive: Path) -> int:
    """Rewrite the records of `archive` without the paths of the machines that wrote them (a
    sweep made before its records were written so, or on another machine): config.toml loses
    out_dir (its folder), summary.json its run_dir and names its checkpoint by folder,
    reused.json names its source as <sweep>/<group>/seed-<n>, sweep.json's sessions lose
    their working folder and their command lines keep only the last component of an absolute
    path. Numbers, fingerprints and everything else stay byte for byte. Returns the files
    rewritten."""
    changed = 0
    for path in sorted(archive.glob(f"*/seed-*/{CONFIG_FILE}")):
        text = path.read_text(encoding="utf-8")
        kept = re.sub(r'(?m)^out_dir = ".*"\n', "", text)
        changed += _rewrite(path, text, kept)
    for path in sorted(archive.glob(f"*/seed-*/{SUMMARY_FILE}")):
        changed += _rewrite_json(path, _portable_summary)
    for path in sorted(archive.glob(f"*/seed-*/{REUSED_FILE}")):
        changed += _rewrite_json(path, lambda r: {**r, "from": "/".join(
            Path(r["from"]).parts[-3:])} if isinstance(r.get("from"), str) else r)
    if (archive / SWEEP_FILE).is_file():
        changed += _rewrite_json(archive / SWEEP_FILE, _portable_sessions)
    return changed


def _portable_summary(record: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in record.items() if k != "run_dir"}
    if isinstance(out.get("checkpoint"), str):
        out["checkpoint"] = Path(out["checkpoint"]).name
    return out


def _portable_sessions(record: dict[str, Any]) -> dict[str, Any]:
    sessions = [{k: (portable_command(v) if k == "command" and isinstance(v, str) else v)
                 for k, v in s.items() if k != "cwd"} if isinstance(s, dict) else s
                for s in record.get("sessions", [])]
    return {**record, "sessions": sessions} if "sessions" in record else record


def _rewrite_json(path: Path, portable: Any) -> int:
    record = read_json_record(path)
    if record is None:
        return 0
    new = portable(record)
    if new == record:
        return 0
    return _rewrite(path, path.read_text(encoding="utf-8"), json.dumps(new, indent=1) + "\n")


def _rewrite(path: Path, old: str, new: str) -> int:
    if new == old:
        return 0
    write_text_atomic(path, new)
    return 1


def _merged_record(src: Path, dest: Path) -> dict[str, Any] | None:
    """The sweep record of an archive that already holds one (of the same spec): src's record
    with dest's groups that src lacks but dest holds runs of, and dest's sessions before src's
    new ones; None when dest has none. (A group dest never ran and src lacks was dropped by an
    edit of the spec: kept, it would be reported as pending for ever.)"""
    theirs = read_json_record(dest / SWEEP_FILE)
    if theirs is None:
        return None
    mine = dict(read_json_record(src / SWEEP_FILE) or {})
    ran = {name: g for name, g in theirs.get("groups", {}).items() if (dest / name).is_dir()}
    mine["groups"] = {**ran, **mine.get("groups", {})}
    old = theirs.get("sessions", [])
    mine["sessions"] = old + [s for s in mine.get("sessions", []) if s not in old]
    created = [c for c in (theirs.get("created"), mine.get("created")) if c]
    if created:
        mine["created"] = min(created)  # ISO 8601 times: the earlier sorts first
    return mine


def _last_launch(sweep: Path) -> str:
    """When the sweep's latest session started (ISO 8601, so later sorts later); "" if never."""
    sessions = (read_json_record(sweep / SWEEP_FILE) or {}).get("sessions", [])
    return max((s.get("started", "") for s in sessions), default="")


def _copied_from(dest: Path, run: Path, src: Path) -> bool:
    """`run` is a copy `qkvlab sweep --reuse DEST` made of DEST's own run, which DEST still
    holds: archived back, it would only gain a reused.json naming itself."""
    where = run.relative_to(src)
    came = (read_json_record(run / REUSED_FILE) or {}).get("from")
    return (came == "/".join((dest.resolve().name, *where.parts))
            and (dest / where / SUMMARY_FILE).is_file())


def _check_destination(src: Path, dest: Path) -> None:
    """The archive goes outside the sweep (inside it, a later archive would copy the copy, and
    a run folder's records would change), and not into the archive of another sweep (its run
    folders would stay, mixed with these)."""
    if dest.resolve().is_relative_to(src.resolve()):
        raise QkvlabError(f"the archive {dest} lies inside the sweep {src}: give a folder "
                          "outside it")
    theirs = dest / SWEEP_FILE
    if not theirs.exists():
        return
    record, mine = read_json_record(theirs), read_json_record(src / SWEEP_FILE)
    spec = (record or {}).get("spec")
    if spec is None or spec != (mine or {}).get("spec"):
        raise QkvlabError(f"{dest} holds the archive of another sweep (spec {spec!r}): give a "
                          "new folder, or remove that archive first")


def _finished_config(run: Path) -> RunConfig | None:
    """The run's config if its summary says it reached the config's max_steps, else None."""
    cfg = load_config(run / CONFIG_FILE)
    return cfg if is_finished(read_json_record(run / SUMMARY_FILE), cfg.steps) else None
