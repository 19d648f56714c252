#!/usr/bin/env bash
# The CPU-scale experiments of record (docs/results/README.md): cpu-paper, cpu-nonlinear-q,
# cpu-encoder-mlm, three seeds each, one after the other; about 4 hours on 2 quiet cores.
# Resumable: run it again after an interruption and it skips finished runs and resumes the
# interrupted one. Then:
#   qkvlab report $OUT/<spec> --out docs/results/<spec> --per-window
#
#   OUT=/root/qkvlab-sweeps scripts/run_cpu_sweeps.sh            # all three specs
#   OUT=/root/qkvlab-sweeps scripts/run_cpu_sweeps.sh cpu-paper  # just one
#
# cpu-nonlinear-q's baseline is cpu-paper's baseline (same config, same seeds): `--reuse` copies
# cpu-paper's finished runs across rather than training them twice.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/sweeps}
SPECS=("$@")
[ ${#SPECS[@]} -eq 0 ] && SPECS=(cpu-paper cpu-nonlinear-q cpu-encoder-mlm)

for spec in "${SPECS[@]}"; do
    echo "== $(date -u +%FT%TZ) qkvlab sweep $spec --out $OUT/$spec"
    reuse=()
    [ "$spec" = cpu-nonlinear-q ] && [ -f "$OUT/cpu-paper/sweep.json" ] && reuse=(--reuse "$OUT/cpu-paper")
    qkvlab sweep "$spec" --out "$OUT/$spec" "${reuse[@]}" || exit $?
done
echo "== $(date -u +%FT%TZ) all done"
