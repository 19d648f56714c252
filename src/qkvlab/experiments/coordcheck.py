"""The coordinate check: does each activation keep its size as the model widens (or deepens)?

A parametrization transfers settings across width only if, at a fixed lr, every tensor's typical
coordinate stays the same size as the width grows, at initialisation and after each of the first
updates (Yang et al., Tensor Programs V, the "coord check"). This trains one config at several
widths (keeping the head size d_k and scaling the number of heads, as the studies do) or depths
for a few steps at a constant lr, and records the mean |x| of five tensors at every step:

  embedding      the token (+ position) embedding, the residual stream's input
  attn_logits    q k^T times the scale, every layer (what the softmax sees)
  attn_out       the attention block's output (after W_O), every layer
  mlp_out        the MLP block's output, every layer
  residual       the residual stream after the last block (the final norm's input)
  output_logits  the LM head's logits

Under depth scaling a block's output carries the branch multiplier L^-alpha by design (so that
L of them add up to a stream of fixed size): attn_out and mlp_out are recorded without it, as
the block computes them before the multiplier, so that every tensor should stay flat.

Under the standard parametrization Adam grows each learned projection's output by about
d x lr per step, so the logits grow with width; under μP they stay flat. `growth` is the test's
measure: the largest over the smallest last-step mean |x| across the shapes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkvlab.data.loader import TokenData
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.model.parametrization import branch_multiplier
from qkvlab.run.config import RunConfig
from qkvlab.run.device import autocast, resolve_device
from qkvlab.run.load import check_vocab, open_data
from qkvlab.train.optim import build_optimizer, set_lr

TENSORS: tuple[str, ...] = ("embedding", "attn_logits", "attn_out", "mlp_out", "residual",
                            "output_logits")


@dataclass(frozen=True)
class CoordCheck:
    """What to measure: the shapes (widths, or depths at the config's width), the steps, the
    constant lr (None: the config's optim.lr) and batch (None: the config's), and how many seeds
    (initial weights and batches) each mean |x| averages: the first steps at a large lr
    oscillate, and one seed's oscillation is not a trend."""

    widths: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()
    steps: int = 4
    lr: float | None = None
    batch_size: int | None = None
    seeds: int = 1

    def __post_init__(self) -> None:
        if bool(self.widths) == bool(self.depths):
            raise QkvlabError("give --widths or --depths (one of them): the shapes to compare")
        for name, values in (("widths", self.widths), ("depths", self.depths)):
            if any(v <= 0 for v in values) or len(set(values)) != len(values):
                raise QkvlabError(f"--{name} must be distinct positive integers, got {values}")
        if self.steps < 1:
            raise QkvlabError(f"--steps must be at least 1, got {self.steps}")
        if self.seeds < 1:
            raise QkvlabError(f"--seeds must be at least 1, got {self.seeds}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise QkvlabError(f"--lr must be a positive number, got {self.lr}")


def at_shape(cfg: RunConfig, width: int | None = None, depth: int | None = None) -> RunConfig:
    """`cfg` at another width (d_k kept, the heads and an explicit MLP or GQA width scaled) or
    depth, with its base shape pinned to the config's own, so μP measures from one base."""
    m = cfg.model
    new: dict[str, Any] = {"base_width": m.base_width or m.n_embd,
                           "base_depth": m.base_depth or m.n_layer, "dropout": 0.0}
    if width is not None:
        if width % m.d_head:
            raise QkvlabError(f"width {width} is not a multiple of the head size {m.d_head}: "
                              "give widths that are")
        heads = width // m.d_head
        new.update(n_embd=width, n_head=heads)
        if m.n_kv_head is not None:
            new["n_kv_head"] = max(1, heads * m.n_kv_head // m.n_head)
        if m.mlp_hidden is not None:
            new["mlp_hidden"] = max(1, m.mlp_hidden * width // m.n_embd)
    if depth is not None:
        new["n_layer"] = depth
    try:
        return dataclasses.replace(cfg, model=dataclasses.replace(m, **new))
    except QkvlabError as exc:
        raise QkvlabError(f"at width {width or m.n_embd}, depth {depth or m.n_layer}: {exc}") \
            from None


class _Probe:
    """Forward hooks that add up the mean |x| of each tensor during one forward pass."""

    def __init__(self, model: GPT):
        self.sums: dict[str, list[float]] = {}
        unfold = 1.0 / branch_multiplier(model.cfg)  # a block's output before its multiplier
        self.handles = [model.drop.register_forward_hook(self._keep("embedding")),
                        model.norm_f.register_forward_hook(self._keep_input("residual"))]
        for _, block in model.layers():
            self.handles += [
                block.attn.register_forward_hook(self._logits),
                block.attn.register_forward_hook(self._keep("attn_out", unfold)),
                block.mlp.register_forward_hook(self._keep("mlp_out", unfold)),
            ]

    def _add(self, name: str, x: torch.Tensor, scale: float = 1.0) -> None:
        self.sums.setdefault(name, []).append(scale * x.detach().float().abs().mean().item())

    def _keep(self, name: str, scale: float = 1.0):
        return lambda _module, _inputs, out: self._add(name, out, scale)

    def _keep_input(self, name: str):
        return lambda _module, inputs, _out: self._add(name, inputs[0])

    def _logits(self, attn, inputs, _out) -> None:
        with torch.no_grad():
            self._add("attn_logits", attn.scores(inputs[0], inputs[1], masked=False))

    def take(self, logits: torch.Tensor) -> dict[str, float]:
        self._add("output_logits", logits)
        out = {k: sum(v) / len(v) for k, v in self.sums.items()}  # the mean over layers
        self.sums = {}
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def measure(cfg: RunConfig, data: TokenData, steps: int, lr: float,
            batch_size: int) -> list[dict[str, float]]:
    """Train `cfg` for `steps` steps at constant `lr`; each tensor's mean |x| at every step
    (step 0: at initialisation; step t: after t updates)."""
    torch.manual_seed(cfg.train.seed)
    device = resolve_device(cfg.train.device)  # "auto": a GPU where one is visible
    check_vocab(cfg, data)
    # the kernel of the dtype the steps below run in (autocast: bf16 only when it says bf16)
    dtype = "bf16" if cfg.train.dtype == "bf16" else "fp32"
    model = GPT(cfg.model.on_device(device.type, dtype)).to(device)
    model.train()
    opt = build_optimizer(model, dataclasses.replace(cfg.optim, lr=lr))
    set_lr(opt, lr)
    probe, records = _Probe(model), []
    try:
        for step in range(steps + 1):
            x, y = data.train_batch(step, 0, batch_size, cfg.model.block_size, cfg.train.seed,
                                    order=cfg.data.order)
            x, y = x.to(device), y.to(device)
            with autocast(device, cfg.train.dtype):
                logits, loss = model(x, y)
            records.append(probe.take(logits))
            if step == steps:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        probe.close()
    return records


def run_coordcheck(cfg: RunConfig, check: CoordCheck, say=print) -> dict[str, Any]:
    """The check's record: the config's parametrization and projection, and one row per
    (shape, step, tensor)."""
    lr = check.lr if check.lr is not None else cfg.optim.lr
    batch = check.batch_size or cfg.train.batch_size
    shapes = [("width", w, at_shape(cfg, width=w)) for w in check.widths] + \
        [("depth", d, at_shape(cfg, depth=d)) for d in check.depths]
    data = open_data(cfg.data, log=lambda _msg: None)  # once: opening checks every token id
    rows = []
    for axis, value, shaped in shapes:
        say(f"{cfg.model.parametrization}, {cfg.model.projection}: {axis} {value}")
        runs = [measure(dataclasses.replace(shaped, train=dataclasses.replace(
            shaped.train, seed=shaped.train.seed + i)), data, check.steps, lr, batch)
            for i in range(check.seeds)]
        for step in range(check.steps + 1):
            rows += [{axis: value, "step": step, "tensor": t,
                      "mean_abs": sum(r[step][t] for r in runs) / len(runs)} for t in TENSORS]
    m = cfg.model
    return {"parametrization": m.parametrization, "projection": m.projection,
            "depth_scaling": m.depth_rule, "base_width": m.base_width or m.n_embd,
            "base_depth": m.base_depth or m.n_layer, "head_dim": m.d_head, "lr": lr,
            "batch_size": batch, "block_size": m.block_size, "dtype": cfg.train.dtype,
            "device": resolve_device(cfg.train.device).type,
            "seeds": [cfg.train.seed + i for i in range(check.seeds)],
            "axis": "width" if check.widths else "depth", "rows": rows}


def growth(record: dict[str, Any], tensor: str, step: int | None = None) -> float:
    """Largest over smallest mean |x| of `tensor` across the shapes at `step` (default: the
    last): 1 means flat."""
    rows = [r for r in record["rows"] if r["tensor"] == tensor]
    step = max(r["step"] for r in rows) if step is None else step
    values = [r["mean_abs"] for r in rows if r["step"] == step]
    return max(values) / min(values)


def draw(records: list[dict[str, Any]], path: Path) -> Path:
    """microsoft/mup's picture: mean |x| against width (or depth), one line per step, a panel
    per tensor, a row per record (e.g. standard above, μP below)."""
    import matplotlib  # only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), len(TENSORS), squeeze=False,
                             figsize=(3.0 * len(TENSORS), 2.7 * len(records)))
    for row, rec in zip(axes, records, strict=True):
        axis = rec["axis"]
        steps = sorted({r["step"] for r in rec["rows"]})
        colors = plt.cm.viridis([i / max(1, len(steps) - 1) for i in range(len(steps))])
        for ax, tensor in zip(row, TENSORS, strict=True):
            for step, color in zip(steps, colors, strict=True):
                pts = sorted((r[axis], r["mean_abs"]) for r in rec["rows"]
                             if r["tensor"] == tensor and r["step"] == step)
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, color=color,
                        label=f"step {step}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{tensor} (x{growth(rec, tensor):.1f})", fontsize=9)
            ax.set_xlabel(f"{axis} ({'n_embd' if axis == 'width' else 'layers'})", fontsize=8)
            ax.tick_params(labelsize=7)
        depth = f", {rec['depth_scaling']}" if axis == "depth" else ""
        row[0].set_ylabel(f"{rec['parametrization']}, {rec['projection']}{depth}\nmean |x|",
                          fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    rec = records[0]
    fig.suptitle(f"Coordinate check: mean |x| against {rec['axis']} after 0-"
                 f"{max(r['step'] for r in rec['rows'])} Adam steps at lr {rec['lr']:g} "
                 "(x: largest / smallest at the last step)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
