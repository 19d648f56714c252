"""The retrofit experiment: a standard pre-LN GPT trained on the embedded Shakespeare corpus,
turned into W_Q = I by each init, healed for the same few steps, against a control.

    python -m qkvlab.commands.retrofit_demo --out runs/retrofit-demo [--base RUN]

Arms (every healing run sees the same batches, lr schedule and validation windows):
  control       the original model (learned W_Q) fine-tuned with the same CE steps: what the
                extra steps alone buy, since the base model is not trained to convergence;
  regress+CE    the least-squares init (qkvlab.retrofit.init), healed with cross-entropy;
  regress+KL    the same init, healed by distillation to the original's logits;
  drop+CE       the trivial init (W_Q removed), healed with cross-entropy;
  basis         theory's best available conversion (approximate_convert), conversion only.
Writes RESULTS.md (the table) and results.json in --out, and the healed regress+CE model as a
regular checkpoint in --out/retrofit-q-identity.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from qkvlab.fsutil import check_tree, portable
from qkvlab.retrofit.checkpoint import RetrofitReport, write_retrofit
from qkvlab.retrofit.heal import HealConfig, heal
from qkvlab.retrofit.init import attention_moments, build_student
from qkvlab.run.config import load_config
from qkvlab.run.device import evaluate
from qkvlab.run.layout import list_checkpoints
from qkvlab.run.load import load_model, open_data
from qkvlab.train import train

BASE_PRESET = "compare-quick"  # 4 layers x 128, context 128, char-level tinyshakespeare
BASE_STEPS = 1200  # the preset's full length
CALIB_BATCHES = 8
CALIB_STEP_OFFSET = 1_000_000


def train_base(out: Path, steps: int) -> Path:
    """The standard model to retrofit (trained once; an existing run is reused)."""
    run = out / "base"
    if list_checkpoints(run):
        return run
    cfg = load_config(BASE_PRESET, [f"train.max_steps={steps}", "train.eval_interval=200",
                                    f"train.ckpt_interval={steps}", "train.tensorboard=false",
                                    f"run.out_dir={run}"])
    train(cfg)
    return run


def run_demo(out: Path, base: Path | None = None, *, steps: int = 100, windows: int = 64,
             eval_every: int = 25, lr: float | None = None, seed: int = 0,
             base_steps: int = BASE_STEPS, log=print) -> dict[str, Any]:
    torch.manual_seed(seed)
    check_tree(out)  # results.json and RESULTS.md are written in place
    out.mkdir(parents=True, exist_ok=True)
    base = base or train_base(out, base_steps)
    teacher, ckpt = load_model(base, "cpu")
    cfg = ckpt.config
    data = open_data(cfg.data, log)
    block = cfg.model.block_size
    vx, vy = data.val_windows(windows, block)
    bs = cfg.train.batch_size

    def val_loss(model) -> float:
        return evaluate(model, vx, vy, bs, torch.device("cpu"), "fp32")

    hc = HealConfig(steps=steps, batch_size=bs, lr=lr or 3 * cfg.optim.min_lr,
                    weight_decay=cfg.optim.weight_decay, beta1=cfg.optim.beta1,
                    beta2=cfg.optim.beta2, grad_clip=cfg.optim.grad_clip, eval_every=eval_every,
                    seed=seed)
    before = val_loss(teacher)
    log(f"original ({ckpt.path}, step {ckpt.step}): val loss {before:.4f}")
    calib = (data.train_batch(CALIB_STEP_OFFSET + i, 0, bs, block, seed)[0]
             for i in range(CALIB_BATCHES))
    moments = attention_moments(teacher, calib)

    arms: dict[str, dict[str, Any]] = {}
    students: dict[str, Any] = {}
    plan = [("control", None, False), ("regress+CE", "regress", False),
            ("regress+KL", "regress", True), ("drop+CE", "drop", False)]
    for name, init, distill in plan:
        t0 = time.perf_counter()
        if init is None:
            model, note, r2 = copy.deepcopy(teacher), "the original, learned W_Q", []
        else:
            model, info = build_student(teacher, init, moments)
            note, r2 = info.note, info.query_r2
        arm_cfg = HealConfig(**{**hc.__dict__, "distill": distill})
        log(f"{name}: {note}")
        result = heal(model, data, arm_cfg, val_loss, teacher=teacher if distill else None,
                      log=log)
        arms[name] = {"init": init, "distill": distill, "note": note, "query_r2": r2,
                      "curve": [list(p) for p in result.curve],
                      "seconds": time.perf_counter() - t0}
        students[name] = (model, result, info if init else None, arm_cfg)
    basis_student, basis_info = build_student(teacher, "basis")
    arms["basis"] = {"init": "basis", "distill": False, "note": basis_info.note,
                     "curve": [[0, val_loss(basis_student)]], "seconds": 0.0}

    model, result, info, arm_cfg = students["regress+CE"]
    report = RetrofitReport(source=ckpt.path, init="regress", init_info=info,
                            heal_config=arm_cfg, before=before, heal_result=result,
                            windows=windows, block_size=block)
    dest = write_retrofit(out / "retrofit-q-identity", model, ckpt, report)
    summary = {"base": portable(ckpt.path), "base_step": ckpt.step, "val_loss_original": before,
               "windows": windows, "block_size": block, "heal_steps": steps, "lr": hc.lr,
               "batch_size": bs, "arms": arms, "checkpoint": portable(dest)}
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "RESULTS.md").write_text(results_markdown(summary), encoding="utf-8")
    log(results_markdown(summary))
    return summary


def results_markdown(summary: dict[str, Any]) -> str:
    """The arms as a Markdown table: val loss after 0, ..., N healing steps."""
    before = summary["val_loss_original"]
    steps = sorted({s for arm in summary["arms"].values() for s, _ in arm["curve"]})
    head = "| arm | " + " | ".join(f"step {s}" for s in steps) + " |"
    lines = [f"Original model (learned W_Q, step {summary['base_step']}): val loss "
             f"{before:.4f} on {summary['windows']} windows x {summary['block_size']} tokens; "
             f"healing: {summary['heal_steps']} steps, batch {summary['batch_size']}, "
             f"peak lr {summary['lr']:.1e}.", "", head,
             "|---|" + "---|" * len(steps)]
    for name, arm in summary["arms"].items():
        curve = dict(arm["curve"])
        cells = []
        for s in steps:
            v = curve.get(s)
            cells.append("" if v is None else (f"{v:.4f}" if math.isfinite(v) and v < 100
                                               else f"{v:.1f}"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
