#!/usr/bin/env bash
# How much of the ideal training speed-up does W_Q = I realise at the baby shape? One pair's
# ratio (baseline step vs W_Q = I step, side by side) scatters by several percent on a shared
# CPU, as much as the effect, so this takes many pairs: RUNS independent processes per attention
# implementation (alternating sdpa and eager), each REPEATS interleaved pairs of STEPS steps,
# then pools every pair for the median ratio and its distribution-free 95% interval.
#
#   OUT=runs/bench/baby-share benchmarks/baby_share.sh       # ~9 minutes on 2 cores
#   OUT=... RUNS=4 REPEATS=5 STEPS=3 benchmarks/baby_share.sh  # the first, shorter protocol
#   OUT=runs/bench/baby-share-compile IMPLS=eager EXTRA=--compile benchmarks/baby_share.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench/baby-share}
RUNS=${RUNS:-3}
REPEATS=${REPEATS:-40}
STEPS=${STEPS:-2}
IMPLS=${IMPLS:-sdpa eager}  # model.attn_impl values, alternated
EXTRA=${EXTRA:-}  # more `qkvlab bench` arguments, e.g. --compile
mkdir -p "$OUT"
for i in $(seq 1 "$RUNS"); do
    for impl in $IMPLS; do
        echo "== run $i: qkvlab bench --shape baby --schemes baseline,q-identity --no-inference" \
             "--repeats $REPEATS --steps $STEPS --set model.attn_impl=$impl $EXTRA"
        # shellcheck disable=SC2086  # EXTRA holds several words on purpose
        qkvlab bench --shape baby --schemes baseline,q-identity --no-inference \
            --repeats "$REPEATS" --steps "$STEPS" --set "model.attn_impl=$impl" $EXTRA \
            --json "$OUT/$impl-$i.json" > /dev/null
    done
done
python benchmarks/share_summary.py "$OUT" | tee "$OUT/summary.txt"
