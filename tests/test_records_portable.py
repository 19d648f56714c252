"""Records hold no machine paths: what `qkvlab archive` writes, and all under docs/results."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qkvlab.experiments.archive import make_portable
from qkvlab.fsutil import portable, portable_command

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
# an absolute path of some machine: /x/y at the start of a word or after a quote, `=`, `(` or
# a colon; ~/x; C:\x. Prose such as "tokens/s" or "d/2" has a letter or digit before its slash.
ABSOLUTE = re.compile(r"""(?:^|[\s"'`=(,;])(/[A-Za-z_.][\w.+-]*/[\w.+/-]*|~/[\w.+-]+|"""
                      r"""[A-Za-z]:\\\\?[\w.+-]+)""")
TEXT = {".json", ".jsonl", ".toml", ".md", ".txt", ".csv"}


def machine_paths(text: str) -> list[str]:
    return [m.group(1) for m in ABSOLUTE.finditer(text)]


def test_the_pattern_finds_paths_and_spares_prose():
    assert machine_paths('"run_dir": "/root/sweeps/a/seed-1"') == ["/root/sweeps/a/seed-1"]
    assert machine_paths("qkvlab sweep x --out /tmp/rf/demo") == ["/tmp/rf/demo"]
    assert machine_paths("see ~/runs and C:\\\\Users") == ["~/runs", "C:\\\\Users"]
    assert machine_paths("13,449 tok/s, d/2 hidden, W_Q/W_K, [a](docs/x.md), 1/sqrt(d)") == []


def test_no_file_under_docs_results_holds_a_machine_path():
    found = {}
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in TEXT and path.is_file():
            hits = machine_paths(path.read_text(encoding="utf-8"))
            if hits:
                found[str(path.relative_to(RESULTS))] = hits[:2]
    assert not found, f"{len(found)} records hold machine paths, e.g. {list(found.items())[:5]}"


def test_portable_paths_and_commands(tmp_path):
    assert portable("runs/a") == "runs/a"  # relative: as given
    assert portable(tmp_path / "run" / "ckpt-1", tmp_path / "run") == "ckpt-1"
    assert portable(tmp_path / "elsewhere" / "x", tmp_path / "run") == "x"
    line = f"qkvlab sweep s --out {tmp_path}/sw --set data.dir={tmp_path}/d --reuse docs/r"
    assert portable_command(line) == "qkvlab sweep s --out sw --set data.dir=d --reuse docs/r"


def test_make_portable_keeps_every_number(tmp_path):
    run = tmp_path / "g" / "seed-1"
    run.mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "g"\nout_dir = "/root/sw/g/seed-1"\n'
                                     '[model]\nattn_scale = 0.125  # resolved: 0.125\n')
    summary = {"run_dir": "/root/sw/g/seed-1", "steps": 10, "final_val_loss": 1.2345678901234,
               "checkpoint": "/root/sw/g/seed-1/ckpt-0000010"}
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (run / "reused.json").write_text(json.dumps({"from": "/home/u/old/g/seed-1"}))
    sweep = {"format": 1, "fingerprint": "abc", "sessions": [
        {"command": "qkvlab sweep s --out /root/sw --jobs 2", "cwd": "/work", "started": "t"}]}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")
    assert make_portable(tmp_path) == 4
    assert make_portable(tmp_path) == 0  # idempotent
    assert (run / "config.toml").read_text() == \
        '[run]\nname = "g"\n[model]\nattn_scale = 0.125  # resolved: 0.125\n'
    assert json.loads((run / "summary.json").read_text()) == \
        {"steps": 10, "final_val_loss": 1.2345678901234, "checkpoint": "ckpt-0000010"}
    assert json.loads((run / "reused.json").read_text()) == {"from": "old/g/seed-1"}
    rec = json.loads((tmp_path / "sweep.json").read_text())
    assert rec["fingerprint"] == "abc"
    assert rec["sessions"] == [{"command": "qkvlab sweep s --out sw --jobs 2", "started": "t"}]
    for p in tmp_path.rglob("*.*"):
        assert not machine_paths(p.read_text()), p


@pytest.mark.slow
def test_an_archived_sweep_reports_and_resumes_from_a_copy(tmp_path, capsys):
    """A clone's archive: the sweep sees its runs as done, and the report reads it."""
    import shutil

    from qkvlab.cli import main

    src = RESULTS / "sweeps" / "cpu-width"
    copy = tmp_path / "cpu-width"
    shutil.copytree(src, copy)
    assert main(["sweep", str(copy), "--dry-run"]) == 0
    assert "18 done, 0 failed, 0 to run" in capsys.readouterr().out
    assert main(["report", str(copy), "--out", str(tmp_path / "rep")]) == 0
    rep = (tmp_path / "rep" / "report.json").read_text()
    assert not machine_paths(rep.replace(str(tmp_path), "")), machine_paths(rep)[:3]
