"""Shape checks of what a checkpoint's state.json and optimizer file hold, before any use.

The manifest proves the files are the ones written; these checks keep a hand-made or foreign
state.json from reaching int(), comparisons, the RNG setters or AdamW as junk. Each returns
what is wrong, in words, or None.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from qkvlab.run.layout import ckpt_step
from qkvlab.run.rng import is_int, is_number, rng_ok

# Optimizer group keys that describe the kernel, not the optimisation: keep the current ones.
KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def state_problem(ckpt: Path, state: dict[str, Any]) -> str | None:
    """What is malformed in the fields of state.json that loading reads, or None."""
    step = state.get("step", 0)
    if not is_int(step) or step < 0:
        return f"step {step!r} is not a non-negative integer"
    folder_step = ckpt_step(ckpt)
    if folder_step is not None and step != folder_step:
        return f"step {step} does not match the folder name {ckpt.name}"
    for key in ("best_val_loss", "val_loss", "train_loss"):
        if state.get(key) is not None and not is_number(state[key]):
            return f"{key} {state[key]!r} is not a number"
    for key in ("skipped_steps", "world_size"):
        if key in state and (not is_int(state[key]) or state[key] < 0):
            return f"{key} {state[key]!r} is not a non-negative integer"
    for rng in [state.get("rng"), *(state.get("rng_ranks") or [])]:
        if not rng_ok(rng):
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


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "flag"
    if is_number(value):
        return "number"
    if isinstance(value, list | tuple) and all(is_number(v) for v in value):
        return f"{len(value)} numbers"
    return type(value).__name__


def _groups_problem(current: list[dict[str, Any]], saved: list[dict[str, Any]]) -> str | None:
    for s, c in zip(saved, current, strict=True):
        if s["params"] != c["params"]:
            return "parameter indices differ from this model's"
        for key, value in c.items():
            if key == "params" or key in KERNEL_KEYS or key not in s:
                continue
            if value is not None and _kind(s[key]) != _kind(value):
                return f"hyperparameter {key} is {s[key]!r}"
            if _kind(value) == "number" and not math.isfinite(s[key]):
                return f"hyperparameter {key} is {s[key]!r}"
    return None


def optimizer_problem(shapes: list[tuple[int, ...]] | None, current: list[dict[str, Any]],
                      saved: list[dict[str, Any]], tensors: dict[str, torch.Tensor],
                      nontensor: Any) -> str | None:
    """What in a saved optimizer state would crash or corrupt AdamW later, or None.

    Checked before anything is loaded: the parameter indices of each group, the kind of each
    hyperparameter (a string lr would only fail at the first step), the tensor names, and the
    moments' shapes against `shapes`, the parameters' in index order, when given
    (load_state_dict does not compare shapes).
    """
    problem = _groups_problem(current, saved)
    if problem:
        return problem
    indices = [i for c in current for i in c["params"]]
    for key, value in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() \
                or int(parts[1]) not in indices:
            return f"unexpected tensor {key!r}"
        idx, name = int(parts[1]), parts[2]
        if not value.is_floating_point():
            return f"{key} is {value.dtype}, not floating point"
        if shapes is not None and idx < len(shapes):
            want = () if name == "step" else tuple(shapes[idx])
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
