#!/usr/bin/env bash
# μP against the standard parametrization, training speed side by side in one process
# (`qkvlab bench --parametrizations standard,mup`: interleaved repeats, μP's tokens/s over the
# standard's, paired repeat by repeat), RUNS processes per setting, bf16 and fp32:
#   - baby shape (6x384, ctx 256, batch 12), μP's base 128 wide and 2 deep (width and depth
#     multipliers 3), baseline and W_Q = I;
#   - the transfer study's base shape run at d = 256 (4 layers, d_k 64, ctx 128, batch 32),
#     base 128 x 4 as in the spec mup-transfer.
# What μP adds: one parameter group per (role, decay) in AdamW instead of two, and for a tied
# head one multiply of the final hidden state (the branch multipliers are folded into weights).
#
#   OUT=runs/bench/mup-speed benchmarks/mup_speed.sh   # ~15 minutes on 2 quiet cores
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench/mup-speed}
RUNS=${RUNS:-2}
FIRST=${FIRST:-1}  # FIRST=3 RUNS=4: two more runs beside the ones in OUT, pooled by the summary
mkdir -p "$OUT"
bench() {  # bench NAME ARGS...
    local name=$1; shift
    echo "== $name: qkvlab bench $*"
    qkvlab bench --parametrizations standard,mup --no-inference "$@" \
        --json "$OUT/$name.json" > "$OUT/$name.txt"
}
for i in $(seq "$FIRST" "$RUNS"); do
    for dtype in bf16 fp32; do
        bench "baby-$dtype-$i" --shape baby --schemes baseline,q-identity --dtype "$dtype" \
            --set base_width=128 --set base_depth=2 --repeats 10 --steps 2
        bench "transfer-d256-$dtype-$i" --shape baby --schemes baseline,q-identity \
            --dtype "$dtype" --batch-size 32 --set n_layer=4 --set n_embd=256 --set n_head=4 \
            --set block_size=128 --set vocab_size=256 --set base_width=128 --set base_depth=4 \
            --repeats 10 --steps 4
    done
done
python benchmarks/mup_speed_summary.py "$OUT"
