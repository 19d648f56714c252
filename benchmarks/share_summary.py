"""Pool the paired speed-ups of several `qkvlab bench` runs (written by benchmarks/baby_share.sh
as OUT/{sdpa,eager}-N.json): per attention implementation, each run's median, the pooled median
over all pairs with its distribution-free 95% interval, and the share of the ideal speed-up
that makes.

    python benchmarks/share_summary.py runs/bench/baby-share
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from qkvlab.bench.report import paired_ratios, share_of
from qkvlab.bench.timing import median_interval


def main(folder: Path) -> None:
    print(f"{'attn_impl':<9} {'runs':>4} {'pairs':>5} {'base step':>9} {'median per run':>28} "
          f"{'pooled':>7} {'95% CI':>13} {'share':>6} {'share 95% CI':>13} {'MFU':>6}")
    ideal = None
    for impl in ("sdpa", "eager"):
        runs = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{impl}-*.json"))]
        if not runs:
            continue
        ideal = runs[0]["summary"]["ideal_speedup"]
        pairs = [r for run in runs for r in paired_ratios(run, "q-identity", "baseline")]
        pooled, ci = statistics.median(pairs), median_interval(pairs)
        step = statistics.median(run["schemes"]["baseline"]["train"]["step_s"]["median"]
                                 for run in runs)
        mfu = statistics.median(run["summary"]["baseline_mfu"] for run in runs)
        per_run = " ".join(f"{run['summary']['measured_speedup']:.3f}" for run in runs)
        print(f"{impl:<9} {len(runs):>4} {len(pairs):>5} {step * 1e3:>6.0f} ms {per_run:>28} "
              f"{pooled:>7.3f} {ci.low:>6.3f}-{ci.high:.3f} {share_of(pooled, ideal):>6.0%} "
              f"{share_of(ci.low, ideal):>5.0%}-{share_of(ci.high, ideal):.0%} {mfu:>6.1%}")
    if ideal is None:
        sys.exit(f"no sdpa-N.json or eager-N.json in {folder}: run benchmarks/baby_share.sh")
    print(f"ideal (FLOPs ratio): {ideal:.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
