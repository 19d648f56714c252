"""`qkvlab report` flags a comparison whose runs trained on different machine kinds or dtypes."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import tiny_config
from qkvlab.cli import main
from qkvlab.run.config import save_config
from qkvlab.run.machine import cpu_model

SPEC = """
[spec]
name = "pair"
base = "base.toml"
seeds = [1, 2]

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"

[[variant]]
name = "qid"
rule = "q-identity"
"""


def sweep(tmp_path: Path, data_dir: Path) -> Path:
    save_config(tiny_config(data_dir, "model.n_layer=1", "model.n_embd=16", "train.max_steps=2",
                            "train.eval_interval=2", "train.eval_windows=4",
                            "train.final_eval_tokens=0"), tmp_path / "base.toml")
    (tmp_path / "pair.toml").write_text(SPEC, encoding="utf-8")
    out = tmp_path / "sw"
    assert main(["sweep", str(tmp_path / "pair.toml"), "--out", str(out)]) == 0
    return out


def report(out: Path, rep: Path) -> tuple[dict, str]:
    assert main(["report", str(out), "--out", str(rep)]) == 0
    return json.loads((rep / "report.json").read_text()), (rep / "report.md").read_text()


def edit(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_a_pair_on_one_machine_is_not_flagged_and_a_mixed_one_is(tmp_path, data_dir):
    out = sweep(tmp_path, data_dir)
    data, text = report(out, tmp_path / "rep")
    assert data["machine_mismatches"] == [] and "Warning" not in text
    assert {(m["machine"], m["dtype"], m["from"]) for m in data["run_machines"]} == \
        {(cpu_model(), "fp32", "summary.json")}
    # seed 2 of the variant ran on another CPU kind
    edit(out / "qid/seed-2/summary.json", lambda s: s["machine"].update(cpu="Other CPU"))
    data, text = report(out, tmp_path / "rep2")
    [m] = data["machine_mismatches"]
    assert m["group"] == "qid" and m["references"] == ["baseline"]
    assert {(x["machine"], x["dtype"], tuple(x["runs"])) for x in m["machines"]} == {
        (cpu_model(), "fp32", ("qid seed 1", "baseline seed 1", "baseline seed 2")),
        ("Other CPU", "fp32", ("qid seed 2",))}
    lines = text.splitlines()
    assert lines[0] == "# qkvlab report: pair" and lines[2].startswith(
        "> **Warning: 1 comparison(s) mix machine kinds or dtypes**")
    assert lines[3].startswith("> - qid vs baseline: ") and "Other CPU fp32: qid seed 2" in lines[3]
    # one CPU kind, but the baseline's seed 1 in bf16: flagged too
    edit(out / "qid/seed-2/summary.json", lambda s: s["machine"].update(cpu=cpu_model()))
    edit(out / "baseline/seed-1/summary.json", lambda s: s.update(dtype="bf16"))
    data, _text = report(out, tmp_path / "rep3")
    [m] = data["machine_mismatches"]
    assert ("bf16", ["baseline seed 1"]) in [(x["dtype"], x["runs"]) for x in m["machines"]]


def test_older_runs_take_the_sweeps_machine_only_where_it_is_certain(tmp_path, data_dir):
    out = sweep(tmp_path, data_dir)
    for summary in out.glob("*/seed-*/summary.json"):  # as runs wrote them before the record
        edit(summary, lambda s: s.pop("machine"))
    data, text = report(out, tmp_path / "rep")
    # every session of the sweep ran on this machine: its runs did
    assert {(m["machine"], m["from"]) for m in data["run_machines"]} == \
        {(cpu_model(), "sweep.json sessions")}
    assert "unknown" not in text.split("## Provenance")[0]
    # a session on another CPU kind: no run can be told apart any more
    def another(record):
        record["sessions"].append({**record["sessions"][0],
                                   "machine": {**record["sessions"][0]["machine"],
                                               "cpu": "Other CPU"}})
    edit(out / "sweep.json", another)
    data, text = report(out, tmp_path / "rep2")
    assert {m["machine"] for m in data["run_machines"]} == {"unknown"}
    assert data["machine_mismatches"] == []  # unknown is never a mismatch
    assert "> Note: the machine of 4 of 4 finished runs is unknown" in text
