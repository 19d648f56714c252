#!/usr/bin/env bash
# The measurements behind DEFAULT_ATTN_IMPL (src/qkvlab/model/config.py), the kernel
# attn_impl = "auto" picks: SDPA and eager timed side by side in one process
# (`qkvlab bench --kernels sdpa,eager`: interleaved repeats, each kernel's tokens/s over the
# default's, paired repeat by repeat), RUNS processes per setting:
#   - baby shape (6x384, ctx 256, batch 12), baseline and W_Q = I, bf16 and fp32: training,
#     and decoding and prefill at contexts 64-256;
#   - the baby model at contexts 512 and 1024 (3,072 tokens a step, as at 256), bf16;
#   - paper shape (12x768, ctx 1024): bf16 at batch 4, fp32 at batch 1, baseline only.
#
#   OUT=runs/bench/kernel-default benchmarks/kernel_default.sh   # ~1.5 hours on 2 busy cores
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench/kernel-default}
RUNS=${RUNS:-2}
mkdir -p "$OUT"
bench() {  # bench NAME ARGS...
    local name=$1; shift
    echo "== $name: qkvlab bench $*"
    qkvlab bench --kernels sdpa,eager "$@" --json "$OUT/$name.json" > "$OUT/$name.txt"
}
for i in $(seq 1 "$RUNS"); do
    for dtype in bf16 fp32; do
        bench "baby-$dtype-$i" --shape baby --schemes baseline,q-identity --dtype "$dtype" \
            --repeats 10 --steps 2 --gen-tokens 0
    done
    for ctx in 512 1024; do
        bench "baby-ctx$ctx-bf16-$i" --shape baby --schemes baseline --dtype bf16 \
            --batch-size $((3072 / ctx)) --set "block_size=$ctx" --repeats 10 --steps 2 \
            --no-inference
    done
    bench "paper-bf16-$i" --shape paper --schemes baseline --dtype bf16 --repeats 8 --steps 1 \
        --no-inference
    bench "paper-fp32-$i" --shape paper --schemes baseline --dtype fp32 --batch-size 1 \
        --repeats 6 --steps 1 --no-inference
done
