"""How each parameter scales with width and depth: the one table of parameter roles (μP).

`model.parametrization` is "standard" (every parameter at init_std and the base lr, whatever the
width: the archived studies) or "mup", the maximal-update parametrization for Adam (Yang et
al., Tensor Programs V), relative to a base shape (`base_width`, `base_depth`): a setting tuned
at the base carries to other widths. `model.depth_scaling` adds the depth rules (depth-μP,
alpha = 1/2; CompleteP, alpha = 1: Dey et al. 2025). The derivation, and what changes when the
query or key is the identity, is docs/theory.md section 7.

Every parameter has a role, decided here from its name and shape and nowhere else:

  embedding  token and position tables (and a head tied to them): fan-in fixed
  hidden     matrices whose fan-in and fan-out both grow with width (W_Q, W_K, W_V, W_O, the
             MLP's, the nonlinear query's)
  readout    an untied output head: fan-in grows with width, fan-out is the vocabulary
  gain       vectors: norm gains, biases, per-head logit gains

With m = n_embd / base_width, mL = n_layer / base_depth and alpha the depth exponent, a role
gives four factors on the base values (`Scaling`): the init std (on init_std), the Adam lr (on
optim.lr), the decay per step (on lr x weight_decay: decay stays independent of each group's lr,
which μP needs to transfer, Kosson et al. 2025), and Adam's eps. The forward multipliers of
μP are folded into these (under Adam a multiplier c on a weight is the same as c times its init
std and lr and eps / c), so the model runs no extra op, with one exception: the readout
multiplier 1/m of a head tied to the embedding, which cannot fold into a table the input also
reads (`readout_multiplier`; export folds it by untying the head). The residual branch
multiplier mL^-alpha of depth scaling folds into the branch's output projection (out_proj,
fc_out).

The optimizer builds its groups from this table (train/optim.py), the model its init
(model/gpt.py), export folds the multiplier (hf/), `qkvlab params --roles` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qkvlab.model.config import DEPTH_ALPHA, ModelConfig

if TYPE_CHECKING:  # the table reads a built model's parameters; gpt.py imports this module
    import torch
    from torch import nn

ROLES: tuple[str, ...] = ("embedding", "hidden", "readout", "gain")
# a residual branch's output projections: the depth multiplier folds into these
BRANCH_OUTPUTS: tuple[str, ...] = ("attn.out_proj.", "mlp.fc_out.")
EMBEDDINGS: tuple[str, ...] = ("wte.weight", "wpe.weight")


@dataclass(frozen=True)
class Scaling:
    """Factors on the base values for one parameter (all 1 under "standard" without depth
    scaling: the model and optimizer are then exactly those of before μP)."""

    init: float = 1.0  # on the parameter's base init std
    lr: float = 1.0  # on optim.lr
    decay: float = 1.0  # on optim.lr x optim.weight_decay, the fraction decayed per step
    eps: float = 1.0  # on optim.eps


@dataclass(frozen=True)
class ParamRule:
    """One row of the table: a parameter, its role, whether it decays, and its factors."""

    name: str
    role: str
    branch: bool  # in a residual branch's output projection
    decays: bool  # matrices and embeddings decay; gains and biases never do
    scaling: Scaling


def width_mult(cfg: ModelConfig) -> float:
    """m = n_embd / base_width under "mup" (1 at the base shape); 1 under "standard"."""
    if cfg.parametrization != "mup":
        return 1.0
    return cfg.n_embd / (cfg.base_width or cfg.n_embd)


def depth_mult(cfg: ModelConfig) -> float:
    """mL = n_layer / base_depth (1 at the base depth or without depth scaling)."""
    if cfg.depth_rule == "none":
        return 1.0
    return cfg.n_layer / (cfg.base_depth or cfg.n_layer)


def residual_depth(cfg: ModelConfig) -> int:
    """The L of GPT-2's residual init std / sqrt(2 L): the model's own depth, or the base depth
    under depth scaling (whose branch multiplier then carries the depth)."""
    return cfg.n_layer if cfg.depth_rule == "none" else (cfg.base_depth or cfg.n_layer)


def branch_multiplier(cfg: ModelConfig) -> float:
    """mL^-alpha, the multiplier on each residual branch's output (folded into its output
    projection: the model's forward never multiplies by it)."""
    return depth_mult(cfg) ** -DEPTH_ALPHA[cfg.depth_rule]


def readout_multiplier(cfg: ModelConfig) -> float:
    """The forward multiplier on the head's input that no weight can absorb: 1/m for a head
    tied to the embedding under "mup"; 1 otherwise (an untied head folds it)."""
    return 1.0 / width_mult(cfg) if cfg.tie_embeddings else 1.0


def role_of(name: str, ndim: int) -> str:
    """The role of parameter `name` (a GPT's named_parameters() name) with `ndim` dims."""
    if name in EMBEDDINGS:
        return "embedding"
    if name == "lm_head.weight":
        return "readout"  # named so only when untied: a tied head is yielded as wte.weight
    return "hidden" if ndim >= 2 else "gain"


def scaling(cfg: ModelConfig, role: str, branch: bool) -> Scaling:
    """The factors of a parameter of `role` (in a residual branch's output: `branch`)."""
    m, mL = width_mult(cfg), depth_mult(cfg)
    a = DEPTH_ALPHA[cfg.depth_rule]
    depth_lr = mL ** (a - 1)  # hidden weights' and gains' Adam lr in depth (CompleteP)
    if role == "embedding":
        base = Scaling()
    elif role == "readout":  # multiplier 1/m folded: init, lr and eps / m
        base = Scaling(init=1 / m, lr=1 / m, eps=1 / m)
    elif role == "hidden":  # init var 1/fan_in, Adam lr 1/fan_in, decay per step fixed
        base = Scaling(init=m ** -0.5, lr=depth_lr / m, decay=depth_lr, eps=mL ** -a / m)
    else:
        base = Scaling(lr=depth_lr, decay=0.0)
    if not branch or a == 0:
        return base
    c = branch_multiplier(cfg)  # folded into the branch's output projection
    return Scaling(init=base.init * c, lr=base.lr * c, decay=base.decay, eps=base.eps / c)


def parameter_table(model: nn.Module, cfg: ModelConfig) -> list[ParamRule]:
    """One row per trainable parameter of `model` (a tied tensor once), in named order."""
    rows = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = role_of(name, p.dim())
        branch = any(part in name for part in BRANCH_OUTPUTS)
        rows.append(ParamRule(name, role, branch, p.dim() >= 2, scaling(cfg, role, branch)))
    return rows


def base_std(cfg: ModelConfig, name: str) -> float:
    """The std a matrix or table starts with at the base shape: init_std, or GPT-2's
    init_std / sqrt(2 L) for a residual branch's output projection."""
    if any(part in name for part in BRANCH_OUTPUTS):
        return cfg.init_std / math.sqrt(2 * residual_depth(cfg))
    return cfg.init_std


def folded_for_export(model: nn.Module) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and CPU weights of a model computing `model`'s logits with no forward
    multiplier, for formats that have none (Hugging Face): a tied head whose readout
    multiplier is not 1 becomes an untied head holding the embedding times it."""
    import dataclasses  # only export needs it

    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    mult = readout_multiplier(model.cfg)
    if mult == 1.0:
        return model.cfg, sd
    sd["lm_head.weight"] = sd["wte.weight"] * mult
    return dataclasses.replace(model.cfg, tie_embeddings=False), sd
