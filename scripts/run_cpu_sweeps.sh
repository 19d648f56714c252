#!/usr/bin/env bash
# The CPU-scale experiments of record (docs/results/README.md), three seeds each, one spec after
# the other, two single-threaded runs at a time (`--jobs 2`, the faster way on 2 cores): more
# than half a day of machine time in all. Resumable: run it again after an interruption and it
# skips finished runs and resumes interrupted ones. Then, per spec:
#   qkvlab report $OUT/<spec> --out docs/results/<spec> --attention
#
#   OUT=/root/qkvlab-sweeps scripts/run_cpu_sweeps.sh            # every spec below
#   OUT=/root/qkvlab-sweeps scripts/run_cpu_sweeps.sh cpu-width  # just one
#
# cpu-nonlinear-q, cpu-ablation, cpu-width and cpu-lr share runs with cpu-paper (same config,
# same seeds): `--reuse` copies cpu-paper's finished runs across rather than training them twice.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/sweeps}
JOBS=${JOBS:-2}
SPECS=("$@")
[ ${#SPECS[@]} -eq 0 ] && SPECS=(cpu-paper cpu-nonlinear-q cpu-encoder-mlm cpu-ablation
                                 cpu-llama cpu-width cpu-lr)

for spec in "${SPECS[@]}"; do
    echo "== $(date -u +%FT%TZ) qkvlab sweep $spec --out $OUT/$spec"
    reuse=()
    case "$spec" in
        cpu-nonlinear-q|cpu-ablation|cpu-width|cpu-lr)
            [ -f "$OUT/cpu-paper/sweep.json" ] && reuse=(--reuse "$OUT/cpu-paper") ;;
    esac
    qkvlab sweep "$spec" --out "$OUT/$spec" --jobs "$JOBS" "${reuse[@]}" || exit $?
done
echo "== $(date -u +%FT%TZ) all done"
