#!/usr/bin/env bash
# The CPU-scale experiments of record (issue 4): cpu-paper, cpu-nonlinear-q, cpu-encoder-mlm,
# three seeds each, one after the other; about 4 hours on 2 quiet cores. Resumable: run it again
# after an interruption and it skips finished runs and resumes the interrupted one. Then:
#   qkvlab report $OUT/<spec> --out docs/results/<spec> --per-window
#
#   OUT=/root/qkvlab-sweeps scripts/run_cpu_sweeps.sh            # all three specs
#   OUT=/root/qkvlab-sweeps scripts/run_cpu_sweeps.sh cpu-paper  # just one
#
# cpu-nonlinear-q's baseline is cpu-paper's baseline (same config, same seeds): its finished runs
# are copied across rather than trained twice.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/sweeps}
SPECS=("$@")
[ ${#SPECS[@]} -eq 0 ] && SPECS=(cpu-paper cpu-nonlinear-q cpu-encoder-mlm)

# Copy cpu-paper's finished baseline runs into cpu-nonlinear-q (after its sweep.json exists).
share_baseline() {
    local src="$OUT/cpu-paper/baseline" dst="$OUT/cpu-nonlinear-q/baseline"
    for run in "$src"/seed-*; do
        [ -f "$run/summary.json" ] && [ ! -e "$dst/$(basename "$run")" ] || continue
        mkdir -p "$dst" && cp -a "$run" "$dst/" || return 1
        sed -i "s#^name = \"cpu-paper-#name = \"cpu-nonlinear-q-#; s#^out_dir = \".*/cpu-paper/#out_dir = \"$(cd "$OUT" && pwd)/cpu-nonlinear-q/#" \
            "$dst/$(basename "$run")/config.toml" || return 1
    done
}

for spec in "${SPECS[@]}"; do
    echo "== $(date -u +%FT%TZ) qkvlab sweep $spec --out $OUT/$spec"
    if [ "$spec" = cpu-nonlinear-q ]; then
        qkvlab sweep "$spec" --out "$OUT/$spec" --only nonlinear-q,wide-mlp || exit $?
        share_baseline || exit $?
    fi
    qkvlab sweep "$spec" --out "$OUT/$spec" || exit $?
done
echo "== $(date -u +%FT%TZ) all done"
