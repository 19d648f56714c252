"""`qkvlab coordcheck CONFIG --widths 64,128,256,512`: μP's coordinate check of a config."""

from __future__ import annotations

from dataclasses import dataclass, field

from qkvlab.commands.common import Subparsers, add_overrides, register
from qkvlab.errors import QkvlabError


def _ints(text: str | None, option: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise QkvlabError(f"{option} takes integers separated by commas, e.g. 64,128,256, got "
                          f"{text!r}") from None


@dataclass
class CoordCheckOptions:
    config: str
    widths: str | None = None
    depths: str | None = None
    steps: int = 4
    lr: float | None = None
    batch_size: int | None = None
    seeds: int = 1
    json: str | None = None
    plot: str | None = None
    against: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)


def run_coordcheck(opts: CoordCheckOptions) -> int:
    """Measure, print each tensor's growth across the shapes, write the record and plot."""
    import json
    from pathlib import Path

    from rich.table import Table

    from qkvlab.console import print_table
    from qkvlab.experiments import coordcheck as cc
    from qkvlab.fsutil import write_text_atomic
    from qkvlab.jsonfile import read_json_object
    from qkvlab.run.config import load_config

    check = cc.CoordCheck(widths=_ints(opts.widths, "--widths"),
                          depths=_ints(opts.depths, "--depths"), steps=opts.steps, lr=opts.lr,
                          batch_size=opts.batch_size, seeds=opts.seeds)
    others = [read_json_object(Path(p), fix="give a file `qkvlab coordcheck --json` wrote")
              for p in opts.against]  # read before the work, so a bad path costs nothing
    if any("rows" not in o or "axis" not in o for o in others):
        raise QkvlabError("--against takes files `qkvlab coordcheck --json` wrote")
    cfg = load_config(opts.config, opts.overrides)
    record = cc.run_coordcheck(cfg, check)
    axis = record["axis"]
    shapes = sorted({r[axis] for r in record["rows"]})
    table = Table(title=f"{record['parametrization']}, {record['projection']}: mean |x| at "
                        f"the last step, largest / smallest across {axis} {shapes[0]}-{shapes[-1]}")
    table.add_column("tensor")
    for other in [*others, record]:
        table.add_column(f"{other['parametrization']}, {other['projection']}", justify="right")
    for tensor in cc.TENSORS:
        table.add_row(tensor, *(f"x{cc.growth(o, tensor):.2f}" for o in [*others, record]))
    print_table(table)
    if opts.json:
        write_text_atomic(Path(opts.json), json.dumps(record, indent=1) + "\n")
    if opts.plot:
        print(f"plot: {cc.draw([*others, record], Path(opts.plot))}")
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("coordcheck", help="μP's coordinate check: activations against width "
                                          "or depth over the first training steps")
    p.add_argument("config", help="TOML config, run folder or preset (as `qkvlab train`)")
    p.add_argument("--widths", help="widths to compare, e.g. 64,128,256,512 (d_k is kept, the "
                                    "heads scale)")
    p.add_argument("--depths", help="depths to compare at the config's width, e.g. 2,4,8,16")
    p.add_argument("--steps", type=int, help="Adam steps at a constant lr (default %(default)s)")
    p.add_argument("--lr", type=float, help="the constant lr (default: the config's optim.lr)")
    p.add_argument("--batch-size", type=int, help="windows per step (default: the config's)")
    p.add_argument("--seeds", type=int, help="seeds each mean |x| averages (default "
                                             "%(default)s; seed = the config's train.seed + i)")
    p.add_argument("--json", metavar="OUT", help="write the record as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw mean |x| against the shape, a line per "
                                                "step")
    p.add_argument("--against", action="append", metavar="JSON",
                   help="another check's --json record, drawn and tabled beside this one")
    add_overrides(p)
    register(p, CoordCheckOptions, run_coordcheck)
