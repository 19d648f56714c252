"""Which machine and dtype each finished run of a report trained on, and the comparisons that
mix them.

Kernels and rounding differ between CPU kinds (an AMD EPYC's fp32 against an Intel Xeon's AMX
bf16), so a gap between two arms, or the spread over one arm's seeds, can be partly the
machine's. A run's summary.json records its machine ("machine": cpu, torch, gpu) and dtype.
For an older run without that record the sweep's sessions (sweep.json) stand in, where they
can: when every session that trained the sweep ran on one machine kind and none was dropped
from the record; otherwise the machine is "unknown".
"""

from __future__ import annotations

from typing import Any

from qkvlab.experiments.results import GroupResult, Report, compared_at_own_shape, paired_shape
from qkvlab.experiments.runs import RunData
from qkvlab.experiments.sweep import MAX_SESSIONS
from qkvlab.run.layout import SUMMARY_FILE
from qkvlab.run.records import read_json_record

UNKNOWN = "unknown"
SHOWN = 10  # mismatches written out in report.md; report.json holds them all


def _kind(machine: dict[str, Any], device: Any) -> str | None:
    """The kind of machine that did the arithmetic: the GPU for a CUDA run, else the CPU."""
    if device == "cuda":
        gpus = machine.get("gpus") or ([machine["gpu"]] if machine.get("gpu") else [])
        return str(gpus[0]) if gpus and len(set(gpus)) == 1 else None
    cpu = machine.get("cpu")
    return str(cpu) if cpu else None


def _session_machine(record: dict[str, Any]) -> dict[str, Any] | None:
    """The one machine every training session of a sweep recorded, or None when that cannot
    be told: sessions on several kinds, sessions dropped from the record (it keeps the last
    MAX_SESSIONS), or commands printed for other machines to run (--print-commands)."""
    sessions = record.get("sessions") or []
    if not sessions or len(sessions) >= MAX_SESSIONS or \
            any(s.get("mode") != "run" for s in sessions):
        return None
    machines = [s.get("machine") or {} for s in sessions]
    seen = {(m.get("cpu"), tuple(m.get("gpus") or ())) for m in machines}
    return machines[0] if len(seen) == 1 and machines[0].get("cpu") else None


def run_machine(run: RunData, sessions: dict[str, Any] | None) -> dict[str, str]:
    """{"machine": kind or "unknown", "dtype": dtype or "unknown", "from": where it was read}."""
    summary = read_json_record(run.run_dir / SUMMARY_FILE) or {}
    device, dtype = summary.get("device"), summary.get("dtype")
    own = summary.get("machine")
    if isinstance(own, dict):
        kind, source = _kind(own, device), "summary.json"
    elif sessions is not None and not run.reused_from:  # a copied run trained elsewhere
        kind, source = _kind(sessions, device), "sweep.json sessions"
    else:
        kind, source = None, "none"
    return {"machine": kind or UNKNOWN, "dtype": str(dtype) if dtype else UNKNOWN,
            "from": source}


def _references(g: GroupResult, rep: Report) -> list[GroupResult]:
    """The groups `g` is compared with: the reference, or the reference's family at g's shape
    for a sweep over widths or budgets (results.compared_at_own_shape)."""
    base = rep.baseline
    if g is base:
        return []
    if compared_at_own_shape(g, base, rep.groups):
        return [h for h in rep.groups if h.group.family == base.group.family
                and paired_shape(h) == paired_shape(g)]
    return [base] if g.paired is not None else []


def machine_report(rep: Report) -> dict[str, Any]:
    """report.json's record of machines: "run_machines", each finished run's machine and
    dtype, and "machine_mismatches", each comparison of the report (a group against its
    references, over the seeds each finished) whose runs trained on more than one machine kind
    or dtype, its runs grouped by (machine, dtype); an unknown machine never makes one."""
    sessions = _session_machine(rep.record)
    machines = {(r.group, r.seed): run_machine(r, sessions)
                for g in rep.groups for r in g.runs if r.status == "done"}
    return {"run_machines": [{"group": g, "seed": s, **m} for (g, s), m in machines.items()],
            "machine_mismatches": _mismatches(rep, machines)}


def _mismatches(rep: Report, machines: dict[tuple[str, int], dict[str, str]]
                ) -> list[dict[str, Any]]:
    out = []
    for g in rep.groups:
        refs = _references(g, rep)
        runs = [r for h in (g, *refs) for r in h.runs if r.status == "done"]
        if not refs or not runs:
            continue
        seen = [machines[(r.group, r.seed)] for r in runs]
        kinds = {m["machine"] for m in seen} - {UNKNOWN}
        dtypes = {m["dtype"] for m in seen} - {UNKNOWN}
        if len(kinds) < 2 and len(dtypes) < 2:
            continue
        by: dict[tuple[str, str], list[str]] = {}
        for r, m in zip(runs, seen, strict=True):
            by.setdefault((m["machine"], m["dtype"]), []).append(f"{r.group} seed {r.seed}")
        out.append({"group": g.group.name, "references": [h.group.name for h in refs],
                    "machines": [{"machine": k, "dtype": d, "runs": names}
                                 for (k, d), names in by.items()]})
    return out


def warning_lines(machines: dict[str, Any]) -> list[str]:
    """report.md's warning: one line per comparison that mixes machines (the first SHOWN), and
    how many runs trained on a machine that no record names."""
    mismatches = machines["machine_mismatches"]
    unknown = sum(m["machine"] == UNKNOWN for m in machines["run_machines"])
    lines = [f"> Note: the machine of {unknown} of {len(machines['run_machines'])} finished "
             "runs is unknown (their summary.json predates the record, and the sweep's "
             "sessions do not tell it)."] if unknown else []
    if not mismatches:
        return lines
    lines += [f"> **Warning: {len(mismatches)} comparison(s) mix machine kinds or dtypes**, "
             "whose kernels round differently, so part of such a gap can be the machine's "
             "(report.json: machine_mismatches):"]
    for m in mismatches[:SHOWN]:
        parts = "; ".join(f"{x['machine']} {x['dtype']}: {', '.join(x['runs'])}"
                          for x in m["machines"])
        lines.append(f"> - {m['group']} vs {', '.join(m['references'])}: {parts}")
    if len(mismatches) > SHOWN:
        lines.append(f"> - and {len(mismatches) - SHOWN} more")
    return lines


def with_warning(markdown: str, machines: dict[str, Any]) -> str:
    """report.md with the warning (machine_report's) right under its title, where no reader
    misses it."""
    lines = warning_lines(machines)
    if not lines:
        return markdown
    title, _, rest = markdown.partition("\n")
    return "\n".join([title, "", *lines, rest])
