"""Pool the runs of benchmarks/kernel_choice.sh (OUT/SHAPE/{sdpa,eager}-N.json): per shape and
scheme, the median training step with each kernel over every timed repeat, and eager's speed-up
over SDPA: the median of the ratios of repeat r of SDPA run i to repeat r of eager run i (the
two processes ran one after the other), with its distribution-free 95% interval.

    python benchmarks/kernel_summary.py runs/bench/kernel
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from qkvlab.bench.timing import median_interval


def step_times(folder: Path, impl: str, scheme: str) -> list[list[float]]:
    """Per run of kernel `impl` (in run order), the step time of each timed repeat of `scheme`."""
    paths = sorted(folder.glob(f"{impl}-*.json"), key=lambda p: int(p.stem.split("-")[-1]))
    runs = [json.loads(p.read_text()) for p in paths]
    return [run["schemes"][scheme]["train"]["step_s"]["values"] for run in runs]


def main(out: Path) -> None:
    print(f"{'shape':<14} {'scheme':<11} {'sdpa step':>10} {'eager step':>11} "
          f"{'eager speed-up':>15} {'95% CI':>13} {'pairs':>8}")
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        for scheme in ("baseline", "q-identity"):
            sdpa, eager = step_times(folder, "sdpa", scheme), step_times(folder, "eager", scheme)
            if not sdpa or not eager:
                continue
            ratios = [s / e for run_s, run_e in zip(sdpa, eager, strict=False)
                      for s, e in zip(run_s, run_e, strict=False)]
            ci = median_interval(ratios)
            all_s = [t for run in sdpa for t in run]
            all_e = [t for run in eager for t in run]
            print(f"{folder.name:<14} {scheme:<11} {statistics.median(all_s) * 1e3:>7.1f} ms "
                  f"{statistics.median(all_e) * 1e3:>8.1f} ms {statistics.median(ratios):>15.3f} "
                  f"{ci.low:>6.3f}-{ci.high:.3f} {len(ratios):>8}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python benchmarks/kernel_summary.py OUT (kernel_choice.sh's folder)")
    main(Path(sys.argv[1]))
