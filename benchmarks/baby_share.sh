#!/usr/bin/env bash
# How much of the ideal training speed-up does W_Q = I realise at the baby shape? One pair's
# ratio (baseline step vs W_Q = I step, side by side) scatters by several percent on a shared
# CPU, as much as the effect, so this takes many pairs: RUNS independent processes per attention
# implementation (alternating sdpa and eager), each REPEATS interleaved pairs of STEPS steps,
# then pools every pair for the median ratio and its distribution-free 95% interval.
#
#   OUT=runs/bench/baby-share benchmarks/baby_share.sh       # ~9 minutes on 2 cores
#   OUT=... RUNS=4 REPEATS=5 STEPS=3 benchmarks/baby_share.sh  # the session-3 protocol
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench/baby-share}
RUNS=${RUNS:-3}
REPEATS=${REPEATS:-40}
STEPS=${STEPS:-2}
mkdir -p "$OUT"
for i in $(seq 1 "$RUNS"); do
    for impl in sdpa eager; do
        echo "== run $i: qkvlab bench --shape baby --schemes baseline,q-identity --no-inference" \
             "--repeats $REPEATS --steps $STEPS --set model.attn_impl=$impl"
        qkvlab bench --shape baby --schemes baseline,q-identity --no-inference \
            --repeats "$REPEATS" --steps "$STEPS" --set "model.attn_impl=$impl" \
            --json "$OUT/$impl-$i.json" > /dev/null
    done
done
python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

from qkvlab.bench.report import share_of
from qkvlab.bench.timing import median_interval

out = Path(sys.argv[1])
print(f"{'attn_impl':<9} {'runs':>4} {'pairs':>5} {'base step':>9} {'median per run':>28} "
      f"{'pooled':>7} {'95% CI':>13} {'share':>6} {'share 95% CI':>13} {'MFU':>6}")
for impl in ("sdpa", "eager"):
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{impl}-*.json"))]
    if not runs:
        continue
    ideal = runs[0]["summary"]["ideal_speedup"]
    per_run = [r["summary"]["measured_speedup"] for r in runs]
    pairs = [q / b for r in runs for q, b in zip(
        r["schemes"]["q-identity"]["train"]["tokens_per_s"]["values"],
        r["schemes"]["baseline"]["train"]["tokens_per_s"]["values"], strict=True)]
    pooled, ci = statistics.median(pairs), median_interval(pairs)
    step = statistics.median(r["schemes"]["baseline"]["train"]["step_s"]["median"] for r in runs)
    mfu = statistics.median(r["summary"]["baseline_mfu"] for r in runs)
    print(f"{impl:<9} {len(runs):>4} {len(pairs):>5} {step * 1e3:>6.0f} ms "
          f"{' '.join(f'{u:.3f}' for u in per_run):>28} {pooled:>7.3f} "
          f"{ci.low:>6.3f}-{ci.high:.3f} {share_of(pooled, ideal):>6.0%} "
          f"{share_of(ci.low, ideal):>5.0%}-{share_of(ci.high, ideal):.0%} {mfu:>6.1%}")
print(f"ideal (FLOPs ratio): {ideal:.3f}")
PY
