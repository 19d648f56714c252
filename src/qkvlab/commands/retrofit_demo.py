"""The command line of the retrofit experiment: `python -m qkvlab.commands.retrofit_demo`."""

from __future__ import annotations

import argparse
from pathlib import Path

from qkvlab.retrofit import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(demo.__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/retrofit-demo"))
    parser.add_argument("--base", type=Path, default=None,
                        help="a trained baseline run to reuse (default: train one)")
    parser.add_argument("--base-steps", type=int, default=demo.BASE_STEPS)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    demo.run_demo(args.out, args.base, steps=args.steps, windows=args.windows,
                  eval_every=args.eval_every, lr=args.lr, seed=args.seed,
                  base_steps=args.base_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
