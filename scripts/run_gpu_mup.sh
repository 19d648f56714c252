#!/usr/bin/env bash
# The μP study's GPU stage as one command, on one GPU machine that reaches nothing outside:
#   coord     the coordinate check at d = 256, 512, 768, 1024 (COORD_WIDTHS) with 12 layers, both
#             parametrizations, both arms (qkvlab coordcheck, fp32, 4 steps, 3 seeds; the committed
#             CPU check's config examples/coordcheck.toml, on the english bytes): a JSON per
#             check and a PNG per arm (standard above μP) in $OUT/coordcheck/
#   transfer  the transfer cross at d = 768 and 1024, 12 layers, both arms: each arm's base lr and
#             alpha and each x/÷ 2 around it, at the base grid's budget (spec mup-transfer-gpu)
#   isoflop-lr  the lr at each budget of the IsoFLOP ladder continued past the CPU's budgets on
#             its 4-layer family (6.4e14, 2.56e15, 1.024e16 FLOPs): each arm at the budget's
#             centre width at the base lr / 4, 8, 16, 32 (spec mup-isoflop-gpu-lr)
#   isoflop   the ladder's sizes, five widths per budget, each arm at its best lr of the
#             budget's scan (spec mup-isoflop-gpu, written once isoflop-lr has run)
# scripts/gpu_mup_specs.py writes the specs (its docstring says why the ladder keeps 4 layers:
# the english corpus is too small for compute-optimal models at d = 768). The base lr
# and alpha: LR and ALPHA (both arms) where set, else each arm's best of the base grid where
# docs/results/mup-transfer/report.json and its archived sweep exist, else 4e-3 and 1.
#
# The data travel as the prepared token files, gzipped (~17 MB). Here, once, from a prepared
# english-bytes folder (DATA_SRC, default data/english-bytes; also fetches the tomli-w wheel):
#   scripts/run_gpu_mup.sh --stage        # into .gpu-stage/ (git-ignored)
# There, from the repository root (`carry` .gpu-stage on a lent device machine):
#   OUT=/tmp/out scripts/run_gpu_mup.sh
# It writes into $OUT: coordcheck/ (4 JSON, 2 PNG), mup-gpu-runs.tar.gz (the finished runs'
# records of the sweeps: config, metrics, summary; rewritten after each part, so a call stopped
# at its time limit still returns what finished) and run.log. Back here:
#   tar -xzf mup-gpu-runs.tar.gz -C /tmp && \
#   qkvlab archive /tmp/mup-gpu-runs/mup-transfer-gpu docs/results/sweeps/mup-transfer-gpu && \
#   qkvlab report docs/results/sweeps/mup-transfer-gpu --out docs/results/mup-transfer-gpu
#
# PARTS (default "coord transfer isoflop-lr isoflop") picks the parts; JOBS (default 4) runs
# train at once on the GPU; the sweeps live in $WORK/sweeps (default WORK=/tmp/qkvlab-gpu-mup)
# and resume there.
# --smoke (or SMOKE=1): every part for a few steps at tiny widths (2 layers, d = 64 and 128), fp32
# on the CPU, on a byte corpus prepared from docs/theory.md: a check of the script anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu-stage
PY=${PY:-python3}

if [ "${1:-}" = "--stage" ]; then
    src=${DATA_SRC:-data/english-bytes}
    if [ ! -f "$src/meta.json" ]; then
        echo "no prepared data at $src: run qkvlab prepare english --tokenizer bytes --out $src" \
             "(or point DATA_SRC at one)" >&2
        exit 2
    fi
    mkdir -p "$STAGE/english-bytes" "$STAGE/whl"
    cp "$src/meta.json" "$STAGE/english-bytes/"
    for split in train val; do
        gzip -c "$src/$split.bin" > "$STAGE/english-bytes/$split.bin.gz"
    done
    (cd "$src" && sha256sum train.bin val.bin) > "$STAGE/english-bytes/SHA256SUMS"
    ls "$STAGE"/whl/tomli_w-*.whl >/dev/null 2>&1 || \
        "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$STAGE/whl" "tomli-w==1.2.0"
    du -sh "$STAGE"
    exit 0
fi

SMOKE=${SMOKE:-0}
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-runs/gpu-mup}
WORK=${WORK:-/tmp/qkvlab-gpu-mup}
JOBS=${JOBS:-4}
PARTS=${PARTS:-coord transfer isoflop-lr isoflop}
mkdir -p "$OUT/coordcheck" "$WORK"
OUT=$(cd "$OUT" && pwd)
WORK=$(cd "$WORK" && pwd)
if ! "$PY" -c "import tomli_w" 2>/dev/null && ls "$STAGE"/whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$STAGE"/whl/*.whl
    export PYTHONPATH=$WORK/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

DATA=$PWD/data/english-bytes
COORD=(--widths "${COORD_WIDTHS:-256,512,768,1024}" --steps 4 --seeds 3
       --set model.n_layer=12)
SPECS=(--dir "$WORK/specs")
ARCHIVE=()  # the attention of each finished run is measured for the report
[ -n "${LR:-}" ] && SPECS+=(--lr "$LR")
[ -n "${ALPHA:-}" ] && SPECS+=(--alpha "$ALPHA")
if [ "$SMOKE" = 1 ]; then
    COORD=(--widths 64,128 --steps 2 --seeds 1 --set model.n_layer=2 --set model.block_size=32
           --set train.batch_size=4 --set train.device=cpu)
    DATA=$WORK/smoke-bytes
    SPECS+=(--smoke --data "$DATA")
    JOBS=1  # in this process: tiny runs start faster than a Python each
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # and train fastest on one thread
    ARCHIVE=(--no-attention)
fi

unpack_data() {  # the staged token files into data/english-bytes, checked against their sums
    local dest=data/english-bytes
    [ -f "$dest/meta.json" ] && return 0
    if [ ! -f "$STAGE/english-bytes/meta.json" ]; then
        echo "no data at $dest and none staged in $STAGE: run scripts/run_gpu_mup.sh --stage" \
             "where the prepared data are" >&2
        return 2
    fi
    local staged=$PWD/$STAGE/english-bytes
    rm -rf "$dest.partial" && mkdir -p "$dest.partial"
    for split in train val; do
        gzip -dc "$staged/$split.bin.gz" > "$dest.partial/$split.bin"
    done
    (cd "$dest.partial" && sha256sum -c --quiet "$staged/SHA256SUMS")
    cp "$staged/meta.json" "$dest.partial/"
    mv "$dest.partial" "$dest"  # complete or absent: a cut-short unpack is redone
}

pack() {  # sweep $1's finished runs' records beside the others' so far, all into $OUT
    local dest=$WORK/pack/mup-gpu-runs/$1
    rm -rf "$dest" && mkdir -p "$WORK/pack/mup-gpu-runs"
    [ -f "$WORK/sweeps/$1/sweep.json" ] && \
        "$PY" -m qkvlab archive "$WORK/sweeps/$1" "$dest" --finished "${ARCHIVE[@]}"
    tar -czf "$OUT/mup-gpu-runs.tar.gz" -C "$WORK/pack" mup-gpu-runs
}

coord() {  # standard first, then μP drawn with it
    for arm in baseline q-identity; do
        local std="$OUT/coordcheck/width-$arm-standard.json" mup="$OUT/coordcheck/width-$arm-mup.json"
        local common=(examples/coordcheck.toml "${COORD[@]}" --set "model.projection=$arm"
                      --set "data.dir=$DATA" --set data.source=english
                      --set data.tokenizer=bytes --set model.vocab_size=256)
        "$PY" -m qkvlab coordcheck "${common[@]}" --set model.parametrization=standard --json "$std"
        "$PY" -m qkvlab coordcheck "${common[@]}" --set model.parametrization=mup --json "$mup" \
            --against "$std" --plot "$OUT/coordcheck/width-$arm.png"
    done
}

sweep() {  # one generated spec, resumable in $WORK/sweeps/<name>
    "$PY" -m qkvlab sweep "$WORK/specs/$1.toml" --out "$WORK/sweeps/$1" --jobs "$JOBS" --yes \
        || echo "sweep exit $?: packing what finished"
    pack "$1"
}

{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
    if [ "$SMOKE" = 1 ]; then
        [ -f "$DATA/meta.json" ] || \
            "$PY" -m qkvlab prepare docs/theory.md --tokenizer bytes --out "$DATA"
    else
        unpack_data
    fi
    "$PY" scripts/gpu_mup_specs.py "${SPECS[@]}"
    for part in $PARTS; do
        echo "== $(date -u +%T) $part"
        case $part in
            coord) coord ;;
            transfer) sweep mup-transfer-gpu ;;
            isoflop-lr) sweep mup-isoflop-gpu-lr ;;
            isoflop) "$PY" scripts/gpu_mup_specs.py "${SPECS[@]}" \
                         --scan "$WORK/sweeps/mup-isoflop-gpu-lr" && sweep mup-isoflop-gpu ;;
            *) echo "unknown part $part (coord, transfer, isoflop-lr, isoflop)" >&2; exit 2 ;;
        esac
    done
} 2>&1 | tee "$OUT/run.log"
ls -la "$OUT" "$OUT/coordcheck"
