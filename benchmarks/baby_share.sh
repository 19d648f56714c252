#!/usr/bin/env bash
# How reproducible is the training speed-up of W_Q = I at the baby shape? Within one
# `qkvlab bench` the repeats are interleaved, but on a shared CPU the whole run can land in a
# faster or slower stretch, so this runs RUNS independent processes per attention
# implementation, alternating sdpa and eager, and summarises the spread of the per-run medians.
#
#   OUT=runs/bench/baby-share RUNS=5 benchmarks/baby_share.sh     # ~5 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench/baby-share}
RUNS=${RUNS:-5}
mkdir -p "$OUT"
for i in $(seq 1 "$RUNS"); do
    for impl in sdpa eager; do
        echo "== run $i: qkvlab bench --shape baby --schemes baseline,q-identity --no-inference" \
             "--repeats 5 --steps 3 --set model.attn_impl=$impl"
        qkvlab bench --shape baby --schemes baseline,q-identity --no-inference --repeats 5 \
            --steps 3 --set "model.attn_impl=$impl" --json "$OUT/$impl-$i.json" > /dev/null
    done
done
python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'attn_impl':<9} {'runs':>4} {'baseline step (ms)':>19} {'speed-up per run':>34} "
      f"{'median':>7} {'share':>6} {'MFU':>6}")
for impl in ("sdpa", "eager"):
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{impl}-*.json"))]
    if not runs:
        continue
    ups = [r["summary"]["measured_speedup"] for r in runs]
    ideal = runs[0]["summary"]["ideal_speedup"]
    steps = [r["schemes"]["baseline"]["train"]["step_s"]["median"] * 1e3 for r in runs]
    mfu = statistics.median(r["summary"]["baseline_mfu"] for r in runs)
    up = statistics.median(ups)
    print(f"{impl:<9} {len(runs):>4} {statistics.median(steps):>19.1f} "
          f"{' '.join(f'{u:.3f}' for u in ups):>34} {up:>7.3f} "
          f"{(up - 1) / (ideal - 1):>6.0%} {mfu:>6.1%}")
print(f"ideal (FLOPs ratio): {ideal:.3f}")
PY
