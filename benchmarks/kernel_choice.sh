#!/usr/bin/env bash
# Which attention kernel should a CPU train with? SDPA against eager, at the shapes qkvlab
# trains on the CPU: baby (6x384, ctx 256), compare-quick (4x128, ctx 128, batch 32), cpu-paper
# (4x256, d_k 64, ctx 128, batch 32) and the Llama-style baby. RUNS separate processes per
# kernel, alternating, each REPEATS interleaved repeats of STEPS steps of baseline and W_Q = I;
# then benchmarks/kernel_summary.py pools the step times per shape and kernel.
#
#   OUT=runs/bench/kernel benchmarks/kernel_choice.sh     # ~10 minutes on 2 quiet cores
#   OUT=runs/bench/kernel-fp32 DTYPE=fp32 benchmarks/kernel_choice.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench/kernel}
RUNS=${RUNS:-2}
REPEATS=${REPEATS:-5}
STEPS=${STEPS:-3}
DTYPE=${DTYPE:-bf16}  # bf16 where the CPU has bf16 matmuls (AVX512-BF16, AMX), else fp32
declare -A SHAPES=(
    [baby]="--shape baby"
    [compare-quick]="--shape baby --batch-size 32 --set n_layer=4 --set n_head=4 --set n_embd=128 --set block_size=128"
    [cpu-paper]="--shape baby --batch-size 32 --set n_layer=4 --set n_head=4 --set n_embd=256 --set block_size=128"
    [baby-llama]="--shape baby-llama"
)
for shape in baby compare-quick cpu-paper baby-llama; do
    mkdir -p "$OUT/$shape"
    for i in $(seq 1 "$RUNS"); do
        for impl in sdpa eager; do
            echo "== $shape run $i: qkvlab bench ${SHAPES[$shape]} --dtype $DTYPE --set attn_impl=$impl"
            # shellcheck disable=SC2086  # the shape's arguments are several words on purpose
            qkvlab bench ${SHAPES[$shape]} --schemes baseline,q-identity --no-inference \
                --dtype "$DTYPE" --repeats "$REPEATS" --steps "$STEPS" --set "attn_impl=$impl" \
                --json "$OUT/$shape/$impl-$i.json" > /dev/null
        done
    done
done
python benchmarks/kernel_summary.py "$OUT" | tee "$OUT/summary.txt"
