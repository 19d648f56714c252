"""Pool the runs of benchmarks/mup_speed.sh (OUT/SETTING-N.json): per setting and scheme, μP's
training tokens/s over the standard parametrization's, the median of the paired ratios of every
run's repeats (each pair sat side by side in one process), with its distribution-free 95%
interval, and whether it is within 2% of 1.

    python benchmarks/mup_speed_summary.py runs/bench/mup-speed
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from qkvlab.bench.report import paired_ratios
from qkvlab.bench.timing import median_interval


def pooled(out: Path) -> dict[tuple[str, str], list[float]]:
    """(setting, scheme) -> μP-over-standard tokens/s ratios of every repeat of every run."""
    ratios: dict[tuple[str, str], list[float]] = defaultdict(list)
    for path in sorted(out.glob("*.json")):
        setting = path.stem.rsplit("-", 1)[0]
        results = json.loads(path.read_text())
        for row in results["summary"].get("parametrizations", {}).values():
            name = f"{row['scheme']}/{row['parametrization']}"
            ratios[(setting, row["scheme"])] += paired_ratios(results, name, row["default"])
    return ratios


def main(out: Path) -> None:
    print(f"{'setting':<20} {'scheme':<11} {'mup / standard':>15} {'95% CI':>13} {'pairs':>6} "
          f"{'within 2%':>10}")
    for (setting, scheme), ratios in pooled(out).items():
        ci = median_interval(ratios)
        within = ci.low >= 0.98 and ci.high <= 1.02
        print(f"{setting:<20} {scheme:<11} {statistics.median(ratios):>15.3f} "
              f"{ci.low:>6.3f}-{ci.high:.3f} {len(ratios):>6} {'yes' if within else 'no':>10}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python benchmarks/mup_speed_summary.py OUT (mup_speed.sh's folder)")
    main(Path(sys.argv[1]))
