"""scripts/run_gpu_mup.sh --smoke: every part of the μP study's GPU stage for a few steps on the
CPU (no GPU, no network), with the records it promises in $OUT."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

from qkvlab.experiments.coordcheck import TENSORS
from qkvlab.experiments.spec import group_name

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "run_gpu_mup.sh"


@pytest.mark.slow
def test_smoke_mode_writes_the_coordinate_checks_and_the_run_records(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "PY": sys.executable,
           "PYTHONPATH": str(REPO / "src")}
    for key in ("LR", "ALPHA", "PARTS", "JOBS", "SMOKE"):
        env.pop(key, None)
    done = subprocess.run(["bash", str(SCRIPT), "--smoke"], cwd=REPO, env={**env, "LR": "3e-3"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "run.log").read_text()
    assert "baseline: lr 0.003, alpha 1 (LR/ALPHA, the rest" in log

    # the coordinate checks: both parametrizations of both arms, drawn per arm
    for arm in ("baseline", "q-identity"):
        for par in ("standard", "mup"):
            record = json.loads((out / "coordcheck" / f"width-{arm}-{par}.json").read_text())
            assert (record["projection"], record["parametrization"]) == (arm, par)
            assert record["device"] == "cpu" and record["dtype"] == "fp32"
            assert {(r["width"], r["tensor"]) for r in record["rows"]} == \
                {(w, t) for w in (64, 128) for t in TENSORS}
        assert (out / "coordcheck" / f"width-{arm}.png").stat().st_size > 10_000

    # the run records of both sweeps, every run finished at its length
    with tarfile.open(out / "mup-gpu-runs.tar.gz") as tar:
        tar.extractall(tmp_path / "records", filter="data")
    root = tmp_path / "records" / "mup-gpu-runs"
    transfer = {p.parent.parent.name: json.loads(p.read_text())
                for p in (root / "mup-transfer-gpu").glob("*/seed-1/summary.json")}
    # per arm and width the centre, lr x/÷ 2 and alpha x/÷ 2
    assert len(transfer) == 2 * 2 * 5
    assert {"q-identity-d128-L2", "q-identity-d128-L2-lr.lr0.0015",
            "q-identity-d128-L2-lr.lr0.006", "baseline-d64-L2-alpha.alpha0.5",
            "baseline-d64-L2-alpha.alpha2"} <= set(transfer)
    assert all(s["steps"] == 2 and s["final_val_loss"] > 0 for s in transfer.values())
    # each budget's lr scan: each arm at the centre width at the base lr / 4, 8, 16, 32
    scan = {p.parent.parent.name: json.loads(p.read_text())
            for p in (root / "mup-isoflop-gpu-lr").glob("*/seed-1/summary.json")}
    assert len(scan) == 2 * 2 * 4  # arms x budgets x lrs
    best: dict[tuple[str, float], tuple[float, float]] = {}  # (arm, budget) -> (loss, lr)
    for name, summary in scan.items():
        config = tomllib.loads((root / "mup-isoflop-gpu-lr" / name / "seed-1" / "config.toml")
                               .read_text())
        assert config["model"]["n_embd"] == 128
        lr, budget = config["optim"]["lr"], config["train"]["flop_budget"]
        assert lr in (7.5e-4, 3.75e-4, 1.88e-4, 9.38e-5)  # 3 significant digits
        key = ("baseline" if name.startswith("baseline") else "q-identity", budget)
        best[key] = min(best.get(key, (math.inf, 0.0)),
                        (summary["final_val_loss_long"]["loss"], lr))
    # the sizes, each arm at its best lr of the budget's scan
    isoflop = {p.parent.parent.name: json.loads(p.read_text())
               for p in (root / "mup-isoflop-gpu").glob("*/seed-1/summary.json")}
    assert len(isoflop) == 2 * 2 * 2  # arms x widths x budgets
    for name, summary in isoflop.items():
        config = tomllib.loads((root / "mup-isoflop-gpu" / name / "seed-1" / "config.toml")
                               .read_text())
        budget = config["train"]["flop_budget"]
        assert "max_steps" not in config["train"]
        assert name == group_name(name.split(".flops")[0], {"flop_budget": budget})
        arm = "baseline" if name.startswith("baseline") else "q-identity"
        assert config["optim"]["lr"] == best[arm, budget][1]
        assert f"{arm} at lr {best[arm, budget][1]:g}" in log
        # the baseline's alpha falls as 128 / d (mup-isoflop's rule), W_Q = I's is carried
        width = config["model"]["n_embd"]
        alpha = 128 / width if name.startswith("baseline") else 1
        assert config["model"]["attn_scale"] == f"{alpha:g}/sqrt(d_k)"
        # every run spent its budget, less than one step's FLOPs left over
        per_step = summary["train_flops"] / summary["steps"]
        assert budget - per_step < summary["train_flops"] <= budget
    assert (root / "mup-transfer-gpu" / "spec.toml").is_file()
