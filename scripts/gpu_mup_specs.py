"""The μP study's GPU stage as two sweep specs (scripts/run_gpu_mup.sh writes them with this).

mup-transfer-gpu: the transfer cross at d = 768 and 1024 with 12 layers, both arms: each arm's
base setting and lr and alpha each x/÷ 2 around it (5 points), at the base grid's budget
(1,000 steps of 4,096 tokens), on mup-transfer's settings (its spec's base and `set`), with
PyTorch's SDPA kernel (the GPU's fastest; the CPU studies use eager).

mup-isoflop-gpu: the IsoFLOP ladder of mup-isoflop continued past its 1.6e14 on the same 4-layer
family and settings: 6.4e14, 2.56e15 and 1.024e16 training FLOPs, five widths per budget (steps
of 64) centred on ~20 tokens per parameter, in bf16 (the CPU stage's fp32 is for CPUs without
AMX), each arm at mup-isoflop's rule: W_Q = I at its base alpha, the baseline at its base
alpha x 128 / d (its best alpha halved from d = 128 to 256 under μP). Not 12 layers at
d = 768-1024: the english corpus holds 35M training bytes, and a compute-optimal model of that
size (85M parameters at d = 768) would read 1.7G tokens, 50 passes over it. On this ladder the
guess at 1.024e16 reads it ~5 times.

Each arm's base setting: --lr and --alpha for both arms where given; else that arm's best of the
base grid (the lowest mean final val loss at d = 128, 4 layers) where its report
(docs/results/mup-transfer/report.json) and archived sweep (docs/results/sweeps/mup-transfer)
exist; else lr 4e-3 and alpha 1.

--smoke: the same specs at tiny shapes (2 layers, d = 64 and 128, context 32, batch 4), fp32 on
the CPU, a few steps each, on the prepared data folder --data names.

    python scripts/gpu_mup_specs.py --dir /tmp/specs [--lr 4e-3] [--alpha 1] [--smoke --data D]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import tomli_w

from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import group_name, load_spec
from qkvlab.model.params import count_params
from qkvlab.run.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "docs/results/mup-transfer/report.json"
ARCHIVE = REPO / "docs/results/sweeps/mup-transfer"
ARMS = ("baseline", "q-identity")  # each is its family's name and its rule
DEFAULT = (4e-3, 1.0)  # lr, alpha: the placeholder until the base grid has its optimum
BASE_SHAPE = (128, 4)  # width, layers of the base grid

TRANSFER_WIDTHS, TRANSFER_LAYERS = (768, 1024), 12
BUDGETS = (6.4e14, 2.56e15, 1.024e16)
TOKENS_PER_PARAM = 20.0  # Chinchilla's ratio, where each budget's widths are centred
HEAD = 64  # d_k: n_head = width / 64

SMOKE_WIDTHS, SMOKE_LAYERS = (64, 128), 2
SMOKE_SET = ("model.block_size=32", "model.attn_impl=sdpa", "train.batch_size=4",
             "train.eval_interval=100", "train.eval_windows=4", "train.final_eval_tokens=256",
             "train.log_interval=1", "train.ckpt_interval=100", "train.dtype=fp32",
             "train.device=cpu", "train.peak_flops=1e12", "data.source=smoke")


def arm_settings(lr: float | None, alpha: float | None) -> dict[str, tuple[float, float, str]]:
    """Per arm (lr, alpha, where they came from)."""
    best = _base_grid_best()
    out = {}
    for arm in ARMS:
        found = best.get(arm)
        base_lr, base_alpha = found[:2] if found else DEFAULT
        source = "the base grid's best" if found else "the placeholder"
        if lr is not None or alpha is not None:
            source = "LR/ALPHA" + (f", the rest {source}" if lr is None or alpha is None else "")
        out[arm] = (lr if lr is not None else base_lr,
                    alpha if alpha is not None else base_alpha, source)
    return out


def _base_grid_best() -> dict[str, tuple[float, float, float]]:
    """Per family, (lr, alpha, loss) of the base grid's group with the lowest mean final val
    loss, from the report and the archived sweep's spec ({} while either is missing)."""
    if not REPORT.is_file() or not (ARCHIVE / "spec.toml").is_file():
        return {}
    losses = {g["group"]: (g.get("final_val_loss") or {}).get("mean")
              for g in json.loads(REPORT.read_text(encoding="utf-8")).get("groups", [])}
    best: dict[str, tuple[float, float, float]] = {}
    for g in load_spec(ARCHIVE).groups():
        m, loss = g.config.model, losses.get(g.name)
        if loss is None or (m.n_embd, m.n_layer) != BASE_SHAPE or g.family not in ARMS:
            continue
        if g.family not in best or loss < best[g.family][2]:
            best[g.family] = (g.config.optim.lr, round(m.alpha, 6), loss)
    return best


def width_alpha(arm: str, alpha: float, width: int) -> float:
    """The arm's alpha at `width` on the IsoFLOP ladder: the baseline's falls as 128 / d (its
    measured trend under μP, mup-isoflop's rule), W_Q = I's is carried unchanged."""
    return round(alpha * BASE_SHAPE[0] / width, 3) if arm == "baseline" else alpha


def _scale(alpha: float) -> str:
    return f"{alpha:g}/sqrt(d_k)"


def _shape(width: int) -> dict[str, int]:
    return {"n_embd": width, "n_head": width // HEAD}


def transfer_spec(settings: dict[str, tuple[float, float, str]], smoke: bool,
                  extra: list[str]) -> dict[str, Any]:
    """The 5-point cross per arm and width: the centre, lr x/÷ 2, alpha x/÷ 2."""
    base = load_spec("mup-transfer")
    widths, layers = (SMOKE_WIDTHS, SMOKE_LAYERS) if smoke else (TRANSFER_WIDTHS,
                                                                 TRANSFER_LAYERS)
    length = ["train.max_steps=2"] if smoke else []  # else the base grid's 1,000 steps
    variants = []
    for arm in ARMS:
        lr, alpha, _ = settings[arm]
        for w in widths:
            name = f"{arm}-d{w}-L{layers}"
            common = {"family": arm, "rule": arm, **_shape(w)}
            variants += [
                {"name": name, **common, "lr": lr, "attn_scale": _scale(alpha),
                 **({"baseline": True} if not variants else {})},
                {"name": f"{name}-lr", **common, "attn_scale": _scale(alpha),
                 "grid": {"lr": [lr / 2, lr * 2]}},
                {"name": f"{name}-alpha", **common, "lr": lr,
                 "grid": {"attn_scale": [_scale(alpha / 2), _scale(alpha * 2)]}},
            ]
    return {"spec": {
        "name": "mup-transfer-gpu",
        "description": f"μP transfer at d = {', '.join(map(str, widths))} and {layers} layers: "
                       "each arm's base setting and lr and alpha x/÷ 2 around it, "
                       "mup-transfer's budget and settings. One seed.",
        "base": base.base,
        "set": [*base.set, f"model.n_layer={layers}", "model.attn_impl=sdpa", *length,
                *extra],
        "seeds": [1]}, "variant": variants}


def centred_widths(budget: float, config: Any, count: int = 5) -> list[int]:
    """`count` widths in steps of 64 around the one whose run at `budget` reads the nearest
    to TOKENS_PER_PARAM tokens per parameter (none under 64)."""
    def distance(width: int) -> float:
        try:
            cfg = config(width, budget)
        except QkvlabError:  # a budget too small for a step of this width
            return math.inf
        tokens = cfg.steps * cfg.tokens_per_step
        return abs(math.log(tokens / count_params(cfg.model).total / TOKENS_PER_PARAM))

    centre = min(range(HEAD, 4097, HEAD), key=distance)
    first = max(HEAD, centre - HEAD * (count // 2))
    return [first + HEAD * i for i in range(count)]


def isoflop_spec(settings: dict[str, tuple[float, float, str]], smoke: bool,
                 extra: list[str]) -> tuple[dict[str, Any], dict[float, list[int]]]:
    """One variant per arm, width and budget, each the group it names."""
    base = load_spec("mup-isoflop")
    head = [*base.set, "model.attn_impl=sdpa", "train.dtype=bf16", *extra]

    def config(width: int, budget: float) -> RunConfig:
        return load_config(base.base_source(), [*head, f"model.n_embd={width}",
                                                f"model.n_head={width // HEAD}",
                                                f"train.flop_budget={budget!r}"])

    if smoke:  # budgets of 1 and 2 steps of the wider smoke shape (~5 and ~8 of the narrower)
        head += [f"model.n_layer={SMOKE_LAYERS}"]
        per_step = config(max(SMOKE_WIDTHS), 1e30).flops_per_step
        plan = {k * per_step: list(SMOKE_WIDTHS) for k in (1.5, 2.5)}
    else:
        plan = {b: centred_widths(b, config) for b in BUDGETS}
    variants = []
    for arm in ARMS:
        lr, alpha, _ = settings[arm]
        for budget, widths in plan.items():
            for w in widths:
                name = group_name(f"{arm}-d{w}", {"flop_budget": budget})  # as a grid names it
                variants.append({"name": name, "family": arm, "rule": arm, **_shape(w),
                                 "flop_budget": budget, "lr": lr,
                                 "attn_scale": _scale(width_alpha(arm, alpha, w)),
                                 **({"baseline": True} if not variants else {})})
    spec = {"spec": {
        "name": "mup-isoflop-gpu",
        "description": "μP IsoFLOP ladder past the CPU's budgets: "
                       + "; ".join(f"{b:.4g} FLOPs at d = {', '.join(map(str, w))}"
                                   for b, w in plan.items())
                       + " (4 layers, d_k = 64). One seed.",
        "base": base.base, "set": head, "seeds": [1]}, "variant": variants}
    return spec, plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="folder to write the two specs into")
    p.add_argument("--lr", type=float, help="both arms' base lr")
    p.add_argument("--alpha", type=float, help="both arms' base alpha (scale x sqrt(d_k))")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, fp32 on the CPU")
    p.add_argument("--data", help="the prepared data folder (default: the specs' own)")
    args = p.parse_args(argv)
    if args.smoke and not args.data:
        p.error("--smoke needs --data (a prepared byte-level data folder)")
    for name in ("lr", "alpha"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"--{name} must be a positive number, got {value}")
    extra = [f"data.dir={args.data}"] if args.data else []
    extra += list(SMOKE_SET) if args.smoke else []
    try:
        settings = arm_settings(args.lr, args.alpha)
        transfer = transfer_spec(settings, args.smoke, extra)
        isoflop, plan = isoflop_spec(settings, args.smoke, extra)
    except QkvlabError as exc:
        print(f"gpu_mup_specs: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in (transfer, isoflop):
        (out / f"{spec['spec']['name']}.toml").write_text(tomli_w.dumps(spec), encoding="utf-8")
    for arm, (lr, alpha, source) in settings.items():
        print(f"{arm}: lr {lr:g}, alpha {alpha:g} ({source})")
    for budget, widths in plan.items():
        print(f"IsoFLOP {budget:.4g} FLOPs: d = {', '.join(map(str, widths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
