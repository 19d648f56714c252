"""The attention logit scale: one table of rules and one pure function from a setting to the number.

`model.attn_scale` is a number (the scale itself), "A/sqrt(d_k)" (A times the standard scale:
the alpha of the scale scans, which carries from one head size to another), or the name of a
rule in SCALE_RULES (docs/theory.md, "The attention scale"). A rule maps (projection, d, d_k,
init_std) to the scale that multiplies q k^T; a new rule is one entry in the table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from qkvlab.errors import require

# Schemes whose logits are raw coordinate products of the norm's output (unit variance), not
# products with a projection initialised at init_std.
IDENTITY_QK: tuple[str, ...] = ("q-identity", "k-identity")
# The logit scales a model may have, a number's or a rule's (the rules give about 0.01 to 1).
# Far outside them training only makes NaN: SDPA returns NaN at 1e-300 (0 in fp32), and at
# 1e30 q k^T overflows.
SCALE_BOUNDS: tuple[float, float] = (1e-4, 1e4)


def _standard(projection: str, d: int, d_k: int, init_std: float) -> float:
    return 1.0 / math.sqrt(d_k)


def _paper(projection: str, d: int, d_k: int, init_std: float) -> float:
    standard = _standard(projection, d, d_k, init_std)
    return standard / 2 if projection in IDENTITY_QK else standard


def _matched(projection: str, d: int, d_k: int, init_std: float) -> float:
    # a projected query coordinate starts with std init_std * sqrt(d) (unit-variance input,
    # N(0, init_std^2) weights); an identity one with std 1
    standard = _standard(projection, d, d_k, init_std)
    return standard * init_std * math.sqrt(d) if projection in IDENTITY_QK else standard


def _unit(projection: str, d: int, d_k: int, init_std: float) -> float:
    # 1/sqrt(d_k) assumes unit-variance queries and keys; at initialisation a projected side's
    # coordinates have std init_std * sqrt(d), an identity side's (the norm's output) 1. The
    # nonlinear query (x + f(x)) / 2 starts near 0.7 and counts as an identity side.
    projected = init_std * math.sqrt(d)
    q = 1.0 if projection in ("q-identity", "nonlinear-q") else projected
    k = 1.0 if projection == "k-identity" else projected
    return _standard(projection, d, d_k, init_std) / (q * k)


def projected_sides(projection: str) -> int:
    """How many of the logit's two factors (query, key) leave the norm through a learned
    projection: 2, or 1 where the query or the key is the identity (the nonlinear query, whose
    (x + f(x)) / 2 keeps the identity's term, counts as one, as in `unit`)."""
    return 1 if projection in (*IDENTITY_QK, "nonlinear-q") else 2


# The english scan's optimum at lr 1e-3 (docs/results, english-scale: the fitted optimum between
# grid points; 4 layers, d_k = 64, 2,500 steps of 4,096 byte tokens) as alpha = A (128 / d)^n,
# by projected sides: (A, n), A the optimum at d = 128 and n the count of projected sides (from
# d = 128 to 256 the measured powers are 2.00 for the baseline and 1.13 for W_Q = I).
FITTED_OPTIMUM: dict[int, tuple[float, float]] = {2: (9.97, 2.0), 1: (4.74, 1.0)}


def _fitted(projection: str, d: int, d_k: int, init_std: float) -> float:
    # Adam moves every weight by about lr a step whatever its size, and the moves of a learned
    # projection add up along its d inputs, so a side's logit factor grows with d during
    # training: the more projected sides, the faster the best scale falls with width.
    alpha_128, power = FITTED_OPTIMUM[projected_sides(projection)]
    return alpha_128 * (128 / d) ** power / math.sqrt(d_k)


@dataclass(frozen=True)
class ScaleRule:
    """How a rule turns the model's shape into its scale."""

    resolve: Callable[[str, int, int, float], float]  # (projection, d, d_k, init_std) -> scale
    learned: bool = False  # one learnable gain per head (initialised at 1) multiplies the scale


SCALE_RULES: dict[str, ScaleRule] = {
    # 1/sqrt(d_k), halved for q-/k-identity: the published recipe, calibrated at d = 768
    "paper": ScaleRule(_paper),
    "standard": ScaleRule(_standard),  # 1/sqrt(d_k) for every scheme
    # q-/k-identity start with the baseline's initial logit std, at any width
    "matched": ScaleRule(_matched),
    "learned": ScaleRule(_matched, learned=True),  # starts at "matched", learns a gain per head
    # the logits of every scheme start with unit std, at any width and init_std
    "unit": ScaleRule(_unit),
    # the best alpha the english scan measured at lr 1e-3, carried across widths as d^-sides
    "fitted": ScaleRule(_fitted),
}


_ALPHA_FORM = re.compile(r"([0-9.eE+-]+)/sqrt\(d_k\)")


def alpha_of(setting: float | str) -> float | None:
    """A of a setting written "A/sqrt(d_k)" (A a positive finite number), else None."""
    match = _ALPHA_FORM.fullmatch(setting.replace(" ", "")) if isinstance(setting, str) else None
    if match is None:
        return None
    try:
        alpha = float(match.group(1))
    except ValueError:
        return None
    return alpha if math.isfinite(alpha) and alpha > 0 else None


def canonical(setting: float | str) -> float | str:
    """One spelling for one setting ("4.0 / sqrt(d_k)" -> "4/sqrt(d_k)"), so that equal
    settings hash alike in sweep fingerprints."""
    alpha = alpha_of(setting)
    return setting if alpha is None else f"{alpha:g}/sqrt(d_k)"


def _rule(name: str) -> ScaleRule:
    require(name in SCALE_RULES,
            f"attn_scale={name!r} is not a number, A/sqrt(d_k) (A > 0) or one of "
            f"{', '.join(SCALE_RULES)}")
    return SCALE_RULES[name]


def attention_scale(setting: float | str, projection: str, d: int, d_k: int,
                    init_std: float) -> float:
    """The logit scale `setting` gives a model of this shape (for a learned rule: its value
    before the per-head gains)."""
    alpha = alpha_of(setting)
    if alpha is not None:
        return alpha / math.sqrt(d_k)
    if isinstance(setting, str):
        return _rule(setting).resolve(projection, d, d_k, init_std)
    return float(setting)


def learns_scale(setting: float | str) -> bool:
    """True when `setting` adds one learnable gain per head."""
    return isinstance(setting, str) and alpha_of(setting) is None and _rule(setting).learned
