#!/usr/bin/env bash
# The compare and benchmark measurements of docs/results/README.md and benchmarks/README.md,
# in one sequential script (a quiet machine: nothing else running). Outputs land in
# docs/results/ (tables as .txt, numbers as .json).
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
R=docs/results
mkdir -p "$R"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
run() {  # run NAME CMD...: time the command, keep its output
    local name=$1; shift
    log "$*"
    { /usr/bin/time -f "wall %e s" "$@"; } > "$R/$name.txt" 2>&1
    echo "exit $?" >> "$R/$name.txt"
    tail -n 3 "$R/$name.txt"
}
run bench-baby-bf16 qkvlab bench --shape baby \
    --schemes baseline,q-identity,q-identity-wide,nonlinear-q --repeats 5 --steps 3 \
    --json "$R/bench-baby-bf16.json"
run compare-quick qkvlab compare --out runs/compare --fresh
cp runs/compare/compare.md "$R/compare-quick.md"; cp runs/compare/compare.png "$R/compare-quick.png"
cp runs/compare/compare.json "$R/compare-quick.json"
run bench-baby-bf16-compile qkvlab bench --shape baby \
    --schemes baseline,q-identity,q-identity-wide,nonlinear-q --compile --repeats 5 --steps 3 \
    --gen-repeats 3 --json "$R/bench-baby-bf16-compile.json"
run bench-baby-bf16-eager qkvlab bench --shape baby \
    --schemes baseline,q-identity,q-identity-wide,nonlinear-q --repeats 5 --steps 3 \
    --set model.attn_impl=eager --json "$R/bench-baby-bf16-eager.json"
rm -rf "$R/bench-baby-share"; mkdir -p "$R/bench-baby-share"
OUT="$R/bench-baby-share" benchmarks/baby_share.sh  # writes its summary.txt
rm -rf "$R/bench-baby-share-compile"; mkdir -p "$R/bench-baby-share-compile"
OUT="$R/bench-baby-share-compile" IMPLS=eager EXTRA=--compile benchmarks/baby_share.sh
run bench-baby-train-eager-b64 qkvlab bench --shape baby --batch-size 64 \
    --schemes baseline,q-identity --no-inference --repeats 16 --steps 1 \
    --set model.attn_impl=eager --json "$R/bench-baby-train-eager-b64.json"
for impl in sdpa eager; do
    run "bench-paper-train-$impl" qkvlab bench --shape paper --schemes baseline,q-identity \
        --no-inference --repeats 16 --steps 1 --set "model.attn_impl=$impl" \
        --json "$R/bench-paper-train-$impl.json"
done
run causal-blocks-paper python benchmarks/causal_blocks.py --shape paper --batch-size 1 --pairs 8
run bench-paper-bf16 qkvlab bench --shape paper --schemes baseline,q-identity --repeats 5 \
    --steps 1 --gen-tokens 512 --json "$R/bench-paper-bf16.json"
log done
