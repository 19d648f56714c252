"""qkvlab's μP against Microsoft's `mup` package on the same model, widths and batches.

    pip install --no-deps mup   # its torchvision requirement would replace a CPU torch
    python scripts/mup_crosscheck.py --widths 64,128,256,512 --projection q-identity

(config: examples/coordcheck.toml, the shape of `qkvlab coordcheck`'s committed plots.)

For each width this builds two copies of one qkvlab GPT with the same initial weights: one
with `model.parametrization = "mup"` and qkvlab's optimizer groups, one standard model that
`mup` parametrizes (its head a MuSharedReadout tied to the embedding, `set_base_shapes`
against the base and a delta width, `mup.init.normal_` for every matrix, MuAdam). It prints,
per width: the largest relative difference between the two init stds of any matrix (mup's
rule against qkvlab's table), and the largest relative difference of the five tensors' mean
|x| over the steps (the `qkvlab coordcheck` probe on both). Equal tables give 0 and float
noise.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from qkvlab.experiments.coordcheck import TENSORS, _Probe, at_shape
from qkvlab.model import GPT
from qkvlab.model.parametrization import base_std, parameter_table
from qkvlab.run.config import load_config
from qkvlab.run.load import open_data
from qkvlab.train.optim import build_optimizer


def mup_model(cfg, base_cfg, delta_cfg):
    """A standard qkvlab GPT parametrized by the `mup` package."""
    import mup

    def build(c):
        model = GPT(dataclasses.replace(c, parametrization="standard"))
        head = mup.MuSharedReadout(model.wte.weight, bias=False)
        model.lm_head = head
        return model

    model, base, delta = build(cfg), build(base_cfg), build(delta_cfg)
    mup.set_base_shapes(model, base, delta=delta)
    # mup's init for every matrix: std / sqrt(fan-in mult)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and name != "wte.weight" and name != "wpe.weight":
            mup.init.normal_(p, std=base_std(cfg, name))
    return model


def stds_differ(ours: GPT, theirs: GPT) -> float:
    """Largest relative difference of the init std each parametrization asks of a matrix."""
    import mup  # noqa: F401 - infshape is set on the parameters by set_base_shapes

    worst = 0.0
    for rule in parameter_table(ours, ours.cfg):
        if rule.role not in ("hidden", "readout"):
            continue
        shape = theirs.get_parameter(rule.name).infshape  # mup.init: std / sqrt(fan-in mult)
        theirs_std = base_std(ours.cfg, rule.name) / (
            shape.width_mult() ** 0.5 if shape.ninf() == 2 else 1.0)
        ours_std = base_std(ours.cfg, rule.name) * rule.scaling.init
        worst = max(worst, abs(ours_std / theirs_std - 1))
    return worst


def trajectories(model, opt, data, cfg, steps: int, batch: int):
    probe, out = _Probe(model), []
    for step in range(steps + 1):
        x, y = data.train_batch(step, 0, batch, cfg.model.block_size, cfg.train.seed)
        logits = model(x)[0]
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        out.append(probe.take(logits))
        if step < steps:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # a constant lr: each group holds its own from the start
    probe.close()
    return out


def main() -> None:
    import mup

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="examples/coordcheck.toml")
    ap.add_argument("--widths", default="64,128,256,512")
    ap.add_argument("--projection", default="baseline")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eps", type=float, default=1e-8, help="Adam eps at the base width")
    args = ap.parse_args()
    cfg0 = load_config(args.config, [f"model.projection={args.projection}",
                                      "model.parametrization=mup", "train.dtype=fp32",
                                      f"optim.eps={args.eps}"])
    data = open_data(cfg0.data, log=lambda _m: None)
    widths = [int(w) for w in args.widths.split(",")]
    base, delta = at_shape(cfg0, width=widths[0]), at_shape(cfg0, width=2 * widths[0])
    print(f"{args.projection}: width, init std rel. diff, mean |x| rel. diff (max over "
          f"{len(TENSORS)} tensors and {args.steps + 1} steps)")
    for width in widths:
        cfg = at_shape(cfg0, width=width)
        torch.manual_seed(0)
        theirs = mup_model(cfg.model, base.model, delta.model)
        ours = GPT(cfg.model)
        diff_std = stds_differ(ours, theirs)
        ours.load_state_dict(theirs.state_dict())  # the same initial weights in both
        mine = trajectories(ours, build_optimizer(ours, dataclasses.replace(
            cfg.optim, lr=args.lr, weight_decay=0.0)), data, cfg, args.steps, args.batch)
        other = trajectories(theirs, mup.MuAdam(theirs.parameters(), lr=args.lr,
                                                betas=(cfg.optim.beta1, cfg.optim.beta2),
                                                eps=cfg.optim.eps), data, cfg, args.steps,
                             args.batch)
        worst = max(abs(a[t] / b[t] - 1) for a, b in zip(mine, other, strict=True)
                    for t in TENSORS)
        print(f"  {width}: {diff_std:.2e}, {worst:.2e}")


if __name__ == "__main__":
    main()
