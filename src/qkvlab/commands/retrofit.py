"""`qkvlab retrofit`: turn a trained standard model into W_Q = I: convert, then heal."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qkvlab.commands.common import Subparsers, register

if TYPE_CHECKING:
    from qkvlab.retrofit.checkpoint import RetrofitReport
    from qkvlab.retrofit.heal import HealConfig


@dataclass
class RetrofitOptions:
    path: str
    to: str = "q-identity"
    init: str = "regress"
    steps: int = 200
    distill: bool = False
    lr: float | None = None
    batch_size: int | None = None
    eval_every: int | None = None
    windows: int | None = None
    calib_batches: int = 8
    compare_inits: bool = False
    seed: int = 0
    out: str | None = None
    data: str | None = None


def run_retrofit(opts: RetrofitOptions) -> int:
    """Run the retrofit and print the loss table."""
    import torch

    from qkvlab.errors import require
    from qkvlab.retrofit.checkpoint import retrofit_checkpoint
    from qkvlab.retrofit.heal import HealConfig
    from qkvlab.run.config import SEED_RANGE, valid_seed
    from qkvlab.run.store import read_checkpoint

    require(valid_seed(opts.seed), f"--seed must be an integer in {SEED_RANGE}, got {opts.seed}")
    run = read_checkpoint(opts.path).config
    hc = HealConfig(
        steps=opts.steps,
        batch_size=opts.batch_size or run.train.batch_size,
        lr=opts.lr if opts.lr is not None else 3 * run.optim.min_lr,
        weight_decay=run.optim.weight_decay, beta1=run.optim.beta1, beta2=run.optim.beta2,
        grad_clip=run.optim.grad_clip, distill=opts.distill, eval_every=opts.eval_every,
        seed=opts.seed)
    torch.manual_seed(opts.seed)
    report = retrofit_checkpoint(
        opts.path, to=opts.to, init=opts.init, heal_config=hc, out=opts.out,
        windows=opts.windows, calib_batches=opts.calib_batches,
        compare_inits=opts.compare_inits, data_dir=opts.data)
    _print_report(report, hc, opts.to)
    return 0


def _print_report(report: RetrofitReport, hc: HealConfig, to: str) -> None:
    print(f"retrofit {report.source} -> {report.dest} ({to}, init {report.init}, "
          f"{hc.steps} {'distillation' if hc.distill else 'cross-entropy'} steps, "
          f"{report.heal_result.seconds:.0f} s)")
    print(f"parameters: {report.params_before:,} -> {report.params_after:,}")
    if report.init_info.query_r2:
        r2 = " ".join(f"{v:.2f}" for v in report.init_info.query_r2)
        print(f"query variance explained by each head's own slice, per layer: {r2}")
    print(f"val loss on {report.windows} windows x {report.block_size} tokens:")
    print(report.table())
    gap0, gap1 = report.after_convert - report.before, report.after_heal - report.before
    print(gap_line(gap0, gap1, healed=hc.steps > 0))


# The smallest conversion gap (nats) whose closed share is printed: ten units of the last digit
# the loss table shows. A share of a smaller gap divides by eval noise (thousands of percent).
GAP_RESOLUTION = 1e-3


def gap_line(gap0: float, gap1: float, healed: bool) -> str:
    """The summary line of the val-loss gaps to the original model after conversion (gap0)
    and after healing (gap1), with the share healing closed when gap0 is big enough to split."""
    if not healed:
        return f"gap to the original: {gap0:+.4f} after conversion (no healing: --steps 0)"
    if not (math.isfinite(gap0) and gap0 > 0):
        return (f"gap to the original: {gap0:+.4f} after conversion (conversion did not raise "
                f"the loss), {gap1:+.4f} after healing")
    if gap0 < GAP_RESOLUTION:
        return (f"gap to the original: {gap0:+.4f} after conversion (under {GAP_RESOLUTION:g}: "
                f"too small to say how much healing closed), {gap1:+.4f} after healing")
    closed = 100 * (1 - gap1 / gap0)
    return (f"gap to the original: {gap0:+.4f} after conversion, {gap1:+.4f} after healing "
            f"({closed:.0f}% closed; with CE healing part of it is just extra training)")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("retrofit",
                       help="turn a trained standard model into W_Q = I: convert, then heal")
    p.add_argument("path", help="run folder or checkpoint folder of a baseline model")
    p.add_argument("--to", choices=["q-identity"],
                   help="target scheme (only q-identity)")
    p.add_argument("--init", choices=["regress", "basis", "drop"],
                   help="regress: per-head least-squares query absorbed into W_K (default); "
                        "basis: theory's best available conversion; drop: just remove W_Q")
    p.add_argument("--steps", type=int, help="healing steps (0: convert only)")
    p.add_argument("--distill", action="store_true",
                   help="heal by distillation (KL to the original model's logits), not plain CE")
    p.add_argument("--lr", type=float,
                   help="healing peak learning rate (default: the run's min_lr x 3)")
    p.add_argument("--batch-size", type=int,
                   help="healing batch size (default: the run's)")
    p.add_argument("--eval-every", type=int,
                   help="validation interval in steps (default: steps / 4)")
    p.add_argument("--windows", type=int,
                   help="validation windows (default: the run's eval_windows, at most 128)")
    p.add_argument("--calib-batches", type=int,
                   help="training batches whose activations fit the regress init")
    p.add_argument("--compare-inits", action="store_true",
                   help="also report every init's loss right after conversion")
    p.add_argument("--seed", type=int, help="seed of the healing batches")
    p.add_argument("--out",
                   help="checkpoint folder to write (default RUN/retrofit-q-identity)")
    p.add_argument("--data",
                   help="prepared data folder (default: the run's; an imported model without "
                        "a tokenizer takes this folder's, whose vocabulary must fit the model)")
    register(p, RetrofitOptions, run_retrofit)
