"""The μP study's GPU stage as three sweep specs (scripts/run_gpu_mup.sh writes them with this).

mup-transfer-gpu: the transfer cross at d = 768 and 1024 with 12 layers, both arms: each arm's
base setting and lr and alpha each x/÷ 2 around it (5 points), at the base grid's budget
(1,000 steps of 4,096 tokens), on mup-transfer's settings (its spec's base and `set`), with
PyTorch's SDPA kernel (the GPU's fastest; the CPU studies use eager).

mup-isoflop-gpu-lr: the lr first, at each budget of the IsoFLOP ladder (mup-isoflop continued
past its 1.6e14 on the same 4-layer family and settings: 6.4e14, 2.56e15 and 1.024e16 training
FLOPs): each arm at the budget's guessed optimal width (below) at the base lr / 4, / 8, / 16
and / 32. μP carries the lr across width, not across the number of steps: on the CPU the best
lr fell 4-8x below the base grid's by 4e13 FLOPs (docs/results/mup-transfer), so a ladder at
the base lr would compare two arms that are both far from their best.

mup-isoflop-gpu (written with --scan, once the lr scan has run): the ladder's sizes, five widths
per budget (steps of 64) centred on the guess, the width whose run reads ~100 tokens per
parameter (as the CPU ladder's minima did), each arm at its best lr of that budget's scan.
Both in bf16 (the CPU stage's fp32 is for CPUs without AMX), each arm at mup-isoflop's rule:
W_Q = I at its base alpha, the baseline at its base alpha x 128 / d (its best alpha halved from
d = 128 to 256 under μP). Not 12 layers at d = 768-1024: the english corpus holds 35M training
bytes, and a compute-optimal model of that size (85M parameters at d = 768) would read 1.7G
tokens, 50 passes over it. Even on this ladder the guess reads it 3, 6 and 14 times at the
three budgets: past ~4 passes repeated tokens are worth less than fresh ones (Muennighoff et
al., 2023), so the top rung's minimum is that of a corpus-bound model, and it moves towards
larger N.

Each arm's base setting: --lr and --alpha for both arms where given; else that arm's best of the
base grid (the lowest mean final val loss at d = 128, 4 layers) where its report
(docs/results/mup-transfer/report.json) and archived sweep (docs/results/sweeps/mup-transfer)
exist; else lr 4e-3 and alpha 1.

--smoke: the same specs at tiny shapes (2 layers, d = 64 and 128, context 32, batch 4), fp32 on
the CPU, a few steps each, on the prepared data folder --data names.

    python scripts/gpu_mup_specs.py --dir /tmp/specs [--lr 4e-3] [--alpha 1] [--smoke --data D]
    python scripts/gpu_mup_specs.py --dir /tmp/specs --scan SWEEP   # + mup-isoflop-gpu.toml
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

import tomli_w

from qkvlab.errors import QkvlabError
from qkvlab.experiments.isoflop import lr_scans
from qkvlab.experiments.report import build_report
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
# where each budget's widths are centred: the CPU ladder's minima (1e13, 4e13, each arm at its
# best lr) read 92-124 tokens per parameter, bytes being cheaper tokens than Chinchilla's ~20
TOKENS_PER_PARAM = 100.0
SCAN_DIVISORS = (4, 8, 16, 32)  # a budget's lr scan: the base lr over these
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


class Rung(NamedTuple):
    """One budget of the ladder: the width of the guessed optimum and the widths run."""

    centre: int
    widths: list[int]


def guessed_width(budget: float, config: Any) -> int:
    """The width (a step of 64) whose run at `budget` reads the nearest to TOKENS_PER_PARAM
    tokens per parameter."""
    def distance(width: int) -> float:
        try:
            cfg = config(width, budget)
        except QkvlabError:  # a budget too small for a step of this width
            return math.inf
        tokens = cfg.steps * cfg.tokens_per_step
        return abs(math.log(tokens / count_params(cfg.model).total / TOKENS_PER_PARAM))

    return min(range(HEAD, 4097, HEAD), key=distance)


def centred_widths(centre: int, count: int = 5) -> list[int]:
    """`count` widths in steps of 64 around `centre`, none under 64."""
    first = max(HEAD, centre - HEAD * (count // 2))
    return [first + HEAD * i for i in range(count)]


def _ladder(smoke: bool, extra: list[str]) -> tuple[list[str], dict[float, Rung]]:
    """The ladder's `set` lines and its rungs."""
    base = load_spec("mup-isoflop")
    head = [*base.set, "model.attn_impl=sdpa", "train.dtype=bf16", *extra]

    def config(width: int, budget: float) -> RunConfig:
        return load_config(base.base_source(), [*head, f"model.n_embd={width}",
                                                f"model.n_head={width // HEAD}",
                                                f"train.flop_budget={budget!r}"])

    if smoke:  # budgets of 1 and 2 steps of the wider smoke shape (~5 and ~8 of the narrower)
        head += [f"model.n_layer={SMOKE_LAYERS}"]
        per_step = config(max(SMOKE_WIDTHS), 1e30).flops_per_step
        return head, {k * per_step: Rung(max(SMOKE_WIDTHS), list(SMOKE_WIDTHS))
                      for k in (1.5, 2.5)}
    centres = {b: guessed_width(b, config) for b in BUDGETS}
    return head, {b: Rung(c, centred_widths(c)) for b, c in centres.items()}


def _ladder_variant(arm: str, alpha: float, width: int, budget: float, lr: float,
                    name: str, family: str) -> dict[str, Any]:
    return {"name": name, "family": family, "rule": arm, **_shape(width),
            "flop_budget": budget, "lr": lr,
            "attn_scale": _scale(width_alpha(arm, alpha, width))}


def _ladder_spec(name: str, description: str, head: list[str],
                 variants: list[dict[str, Any]]) -> dict[str, Any]:
    variants[0]["baseline"] = True  # the baseline arm's first group
    return {"spec": {"name": name, "description": description,
                     "base": load_spec("mup-isoflop").base, "set": head, "seeds": [1]},
            "variant": variants}


def _describe(widths: dict[float, list[int]]) -> str:
    return "; ".join(f"{b:.4g} FLOPs at d = {', '.join(map(str, w))}"
                     for b, w in widths.items())


def scan_lrs(base_lr: float) -> list[float]:
    """A budget's lr scan: the base lr over SCAN_DIVISORS, rounded to 3 significant digits."""
    return [float(f"{base_lr / k:.3g}") for k in SCAN_DIVISORS]


def isoflop_lr_spec(settings: dict[str, tuple[float, float, str]], smoke: bool,
                    extra: list[str]) -> tuple[dict[str, Any], dict[float, Rung]]:
    """Each arm at each budget's guessed optimal width at scan_lrs(its base lr), a family per
    arm and lr (W_Q = I's met by the baseline's at the same lr, as in mup-isoflop's scans)."""
    head, plan = _ladder(smoke, extra)
    reference = scan_lrs(settings[ARMS[0]][0])  # the baseline's lrs, each a family
    variants = []
    for arm in ARMS:
        lr, alpha, _ = settings[arm]
        for budget, (centre, _) in plan.items():
            for x in scan_lrs(lr):
                family = f"{arm}-lr{x:g}"
                v = _ladder_variant(arm, alpha, centre, budget, x, group_name(
                    f"{family}-d{centre}", {"flop_budget": budget}), family)
                if arm != ARMS[0] and x in reference:
                    v["versus"] = f"{ARMS[0]}-lr{x:g}"
                variants.append(v)
    at = _describe({b: [r.centre] for b, r in plan.items()})
    about = (f"μP IsoFLOP ladder, the lr first: {at} (4 layers, d_k = 64), each arm at its base "
             f"lr over {', '.join(map(str, SCAN_DIVISORS))}. One seed.")
    return _ladder_spec("mup-isoflop-gpu-lr", about, head, variants), plan


def scan_best(sweep_dir: Path) -> dict[tuple[str, float], tuple[float, bool]]:
    """Per (arm, budget), the best lr of the finished lr scan in `sweep_dir` (a sweep of
    mup-isoflop-gpu-lr) and whether a run on each side of it brackets it."""
    rep = build_report(load_spec(sweep_dir), sweep_dir)
    rule = {g.group.name: g.rule for g in rep.groups}
    return {(str(rule[sc.points[0].group]), sc.budget): (sc.best.lr, sc.bracketed)
            for sc in lr_scans(rep)}


def isoflop_spec(settings: dict[str, tuple[float, float, str]], smoke: bool, extra: list[str],
                 best: dict[tuple[str, float], tuple[float, bool]]
                 ) -> tuple[dict[str, Any], dict[float, Rung]]:
    """One variant per arm, width and budget, each the group it names, at that arm's best lr
    of the budget's scan (`best`, from scan_best)."""
    head, plan = _ladder(smoke, extra)
    missing = [f"{arm} at {b:.4g}" for arm in ARMS for b in plan if (arm, b) not in best]
    if missing:
        raise QkvlabError(f"the lr scan has no result for {', '.join(missing)}: run its sweep "
                          "(mup-isoflop-gpu-lr) to the end first")
    variants = []
    for arm in ARMS:
        _, alpha, _ = settings[arm]
        for budget, (_, widths) in plan.items():
            for w in widths:
                name = group_name(f"{arm}-d{w}", {"flop_budget": budget})  # as a grid names it
                variants.append(_ladder_variant(arm, alpha, w, budget, best[arm, budget][0],
                                                name, arm))
    about = (f"μP IsoFLOP ladder past the CPU's budgets: "
             f"{_describe({b: r.widths for b, r in plan.items()})} (4 layers, d_k = 64), each "
             "arm at its best lr of the budget's scan (mup-isoflop-gpu-lr). One seed.")
    return _ladder_spec("mup-isoflop-gpu", about, head, variants), plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="folder to write the specs into")
    p.add_argument("--lr", type=float, help="both arms' base lr")
    p.add_argument("--alpha", type=float, help="both arms' base alpha (scale x sqrt(d_k))")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, fp32 on the CPU")
    p.add_argument("--data", help="the prepared data folder (default: the specs' own)")
    p.add_argument("--scan", type=Path, metavar="SWEEP",
                   help="the lr scan's sweep folder: also write the ladder's sizes at each "
                        "arm's best lr of it (mup-isoflop-gpu.toml)")
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
        specs = [transfer_spec(settings, args.smoke, extra)]
        scan, plan = isoflop_lr_spec(settings, args.smoke, extra)
        specs.append(scan)
        if args.scan:
            best = scan_best(args.scan)
            specs.append(isoflop_spec(settings, args.smoke, extra, best)[0])
    except QkvlabError as exc:
        print(f"gpu_mup_specs: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        (out / f"{spec['spec']['name']}.toml").write_text(tomli_w.dumps(spec), encoding="utf-8")
    for arm, (lr, alpha, source) in settings.items():
        print(f"{arm}: lr {lr:g}, alpha {alpha:g} ({source}); the ladder's lr scan: "
              + ", ".join(f"{x:g}" for x in scan_lrs(lr)))
    for budget, (centre, widths) in plan.items():
        at = "".join(f"; {arm} at lr {best[arm, budget][0]:g}"
                     + ("" if best[arm, budget][1] else " (an end of its scan: a bound)")
                     for arm in ARMS) if args.scan else ""
        print(f"IsoFLOP {budget:.4g} FLOPs: d = {', '.join(map(str, widths))}, the lr scanned "
              f"at d = {centre}{at}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
