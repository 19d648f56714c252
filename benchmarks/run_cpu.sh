#!/usr/bin/env bash
# The CPU benchmark of record: run it on a QUIET machine (nothing else running; check `uptime`).
# Every command compares the schemes side by side in one process with interleaved repeats, so
# drift hits all schemes alike, but a busy neighbour still widens the spread: the tables show
# each scheme's range, and the JSON files keep every repeat.
#
#   benchmarks/run_cpu.sh            # all of it: about an hour on 2 cores
#   OUT=/tmp/bench benchmarks/run_cpu.sh baby   # only the baby-shape runs
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
OUT=${OUT:-runs/bench}
WHICH=${1:-all}
mkdir -p "$OUT"

run() {  # run NAME ARGS...: table to NAME.txt (and the terminal), numbers to NAME.json
    local name=$1; shift
    echo "== qkvlab bench $* --json $OUT/$name.json"
    qkvlab bench "$@" --json "$OUT/$name.json" | tee "$OUT/$name.txt"
}

if [ "$WHICH" = all ] || [ "$WHICH" = baby ]; then
    # nanoGPT's baby shape (6x384, ctx 256, 65 chars), batch 12, bf16 autocast: the four
    # variants, training + prefill/decode at 64/128/256 + generate() of 512 tokens. ~15 min.
    run baby-bf16 --shape baby --schemes baseline,q-identity,q-identity-wide,nonlinear-q \
        --repeats 7 --steps 3
    # the same in fp32 (training only): the ideal speed-up does not depend on the dtype, the
    # share realised does. ~10 min.
    run baby-fp32 --shape baby --schemes baseline,q-identity --dtype fp32 --no-inference \
        --repeats 7 --steps 3
    # torch.compile (inductor; needs gcc, a minute or two of compiling first), training and
    # inference (generate() through compiled_forward). ~8 min.
    run baby-bf16-compile --shape baby --schemes baseline,q-identity --compile \
        --repeats 7 --steps 3 --gen-repeats 3
fi

if [ "$WHICH" = all ] || [ "$WHICH" = paper ]; then
    # GPT-2 small as in the paper (12x768, ctx 1024, vocab 50304), batch 4 on CPU: ~10 s per
    # training step on 2 cores. Inference at 128/512/1024 and generate() of 512 tokens (no
    # sliding window at ctx 1024: the cache's speed-up shows in full). ~30 min.
    run paper-bf16 --shape paper --schemes baseline,q-identity --repeats 5 --steps 2
fi
