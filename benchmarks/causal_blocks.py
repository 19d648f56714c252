"""What the blocked causal path of eager attention buys: one model's training step timed with
the blocks (model.attention_kernels.causal_block_rows, the default) and with one block of all
rows, the two interleaved in pairs whose order flips, on the same weights and batch.

    python benchmarks/causal_blocks.py --shape paper --batch-size 1 --pairs 6   # ~1 min
    python benchmarks/causal_blocks.py --shape baby --batch-size 12 --pairs 16
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from qkvlab.bench.run import SHAPES
from qkvlab.bench.timing import interleaved, median_interval
from qkvlab.bench.workloads import TrainBench
from qkvlab.model import ModelConfig, attention_kernels
from qkvlab.perf import keep_freed_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="paper", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=6)
    args = ap.parse_args()
    keep_freed_memory()
    cfg = replace(ModelConfig(**SHAPES[args.shape].model), attn_impl="eager")
    bench = TrainBench(cfg, args.batch_size, torch.device("cpu"), torch.bfloat16, False)
    default_rows = attention_kernels.causal_block_rows
    modes = {"blocks": default_rows, "one block": lambda n_q: n_q}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(2):
        bench.step()  # warm-up
    for r in range(args.pairs):
        for name in interleaved(list(modes), r):
            attention_kernels.causal_block_rows = modes[name]
            bench.step()  # a first step at this block size, untimed
            times[name].append(bench.time_steps(1))
    attention_kernels.causal_block_rows = default_rows
    ratios = [one / blocked for one, blocked in zip(times["one block"], times["blocks"],
                                                    strict=True)]
    ci = median_interval(ratios)
    rows = default_rows(cfg.block_size)
    print(f"{args.shape}, batch {args.batch_size} x {cfg.block_size}, bf16, eager attention")
    for name, ts in times.items():
        print(f"  {name:<9} step {statistics.median(ts) * 1e3:8.1f} ms (median of {len(ts)})")
    print(f"  speed-up of {rows}-row blocks: {statistics.median(ratios):.3f} "
          f"[{ci.low:.3f}, {ci.high:.3f}] ({100 * ci.coverage:.0f}% interval)")


if __name__ == "__main__":
    main()
