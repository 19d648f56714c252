"""The paper's model variants (docs/paper.md section 5) and the rules that derive them from a base.

The rules, stated once, in RULE_TABLE: W_Q = I trains at the "paper" attention scale (halved)
with weight decay 2^-5 instead of 0.1 (`qkvlab compare` also at each arm's tuned scale);
"reallocated" moves the d^2 saved per layer into the MLP (hidden + d/2, i.e. 4d -> 4.5d). A
rule *sets* some keys whatever the base says (its `settings` and weight decay) and *derives*
others from the base's (an MLP or a width).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from qkvlab.errors import QkvlabError, require
from qkvlab.model.config import ModelConfig

BASELINE_WEIGHT_DECAY = 0.1
REDUCED_WEIGHT_DECAY = 2.0**-5

PAPER_SHAPE = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    model: ModelConfig
    weight_decay: float


# ---- derivations of a shape from the base's ------------------------------------------------
def saved_hidden(base: ModelConfig) -> int:
    """MLP hidden units that hold the d^2 weights W_Q = I saves per layer: d/2 for the GELU
    MLP's two matrices, d/3 (rounded) for SwiGLU's three."""
    return round(base.n_embd / base.mlp_matrices)


def wider_mlp(base: ModelConfig) -> ModelConfig:
    """The MLP given the d^2 per layer W_Q = I saves: hidden + d/2 (SwiGLU: + d/3)."""
    return dataclasses.replace(base, mlp_hidden=base.hidden + saved_hidden(base))


def smaller_mlp(base: ModelConfig) -> ModelConfig:
    """The MLP shrunk by the d^2 per layer W_Q = I saves (hidden - d/2).

    Said as a ratio when the base says one (4d -> 3.5d), so the paper's base gives exactly the
    control of `paper_variants`.
    """
    if base.mlp_hidden is None and base.mlp == "gelu":
        return dataclasses.replace(base, mlp_ratio=base.mlp_ratio - 0.5)
    return dataclasses.replace(base, mlp_hidden=base.hidden - saved_hidden(base))


def narrower(base: ModelConfig) -> ModelConfig:
    """Every head 2 dimensions narrower (the paper's d = 768 -> 744)."""
    if base.head_dim is not None:
        raise QkvlabError("rule narrower shrinks n_embd and derives the head size from it: unset "
                          "model.head_dim or give the variant an explicit n_embd instead")
    return dataclasses.replace(base, n_embd=base.n_embd - 2 * base.n_head)


# ---- the rules ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """A named derivation of a variant from a base model config."""

    description: str
    weight_decay: float
    settings: Mapping[str, Any] = field(default_factory=dict)  # model keys it sets outright
    shape: Callable[[ModelConfig], ModelConfig] | None = None  # sizes derived from the base's

    def keys(self) -> frozenset[str]:
        """The section.key names this rule sets whatever the base says."""
        return frozenset({"optim.weight_decay", *(f"model.{k}" for k in self.settings)})


W_Q_IDENTITY: Mapping[str, Any] = {"projection": "q-identity", "attn_scale": "paper"}
W_Q_IDENTITY_STANDARD: Mapping[str, Any] = {"projection": "q-identity", "attn_scale": "standard"}
# Each arm's best attention scale at `qkvlab compare`'s quick shape (4x128, d_k = 32, 1,200
# steps of tinyshakespeare; spec compare-quick-scale, 3 seeds,
# docs/results/compare-quick-scale/README.md), as
# alpha / sqrt(d_k): what compare runs, so neither arm is compared at a scale that handicaps it
TUNED_BASELINE_SCALE = "4/sqrt(d_k)"
TUNED_Q_IDENTITY_SCALE = "2.83/sqrt(d_k)"
W_Q_IDENTITY_TUNED: Mapping[str, Any] = {"projection": "q-identity",
                                         "attn_scale": TUNED_Q_IDENTITY_SCALE}

# The names are those of `compare_variants` and `paper_variants` (applied to the paper's base
# they give exactly its five variants), W_Q = I at the standard scale, "nonlinear-q"
# (docs/paper.md section 6: Q(X) = (X + f(X)) / 2, keys and values linear, the usual scale;
# weight decay 0.1, as the paper's best nonlinear-query run), and W_K = I, W_V = I.
RULE_TABLE: dict[str, Rule] = {
    "baseline": Rule("W_Q, W_K, W_V", BASELINE_WEIGHT_DECAY),
    "baseline-tuned": Rule("W_Q, W_K, W_V, its tuned scale", BASELINE_WEIGHT_DECAY,
                           {"attn_scale": TUNED_BASELINE_SCALE}),
    "q-identity-tuned": Rule("W_Q = I, its tuned scale", REDUCED_WEIGHT_DECAY,
                             W_Q_IDENTITY_TUNED),
    "q-identity-tuned-wide": Rule("W_Q = I, its tuned scale, MLP + d/2", REDUCED_WEIGHT_DECAY,
                                  W_Q_IDENTITY_TUNED, wider_mlp),
    "q-identity": Rule("W_Q = I, the paper's recipe", REDUCED_WEIGHT_DECAY, W_Q_IDENTITY),
    "q-identity-wide": Rule("W_Q = I, MLP + d/2", REDUCED_WEIGHT_DECAY, W_Q_IDENTITY, wider_mlp),
    "q-identity-standard": Rule("W_Q = I, standard scale", REDUCED_WEIGHT_DECAY,
                                W_Q_IDENTITY_STANDARD),
    "q-identity-standard-wide": Rule("W_Q = I, standard scale, MLP + d/2", REDUCED_WEIGHT_DECAY,
                                     W_Q_IDENTITY_STANDARD, wider_mlp),
    "smaller-mlp": Rule("control: W_Q, MLP - d/2", BASELINE_WEIGHT_DECAY, shape=smaller_mlp),
    "narrower": Rule("control: W_Q, head size - 2", BASELINE_WEIGHT_DECAY, shape=narrower),
    "nonlinear-q": Rule("Q = (X + f(X)) / 2", BASELINE_WEIGHT_DECAY,
                        {"projection": "nonlinear-q", "attn_scale": "paper"}),
    # the other two projections the result removes (docs/paper.md section 1), with W_Q = I's
    # weight decay: W_K = I scales the logits as W_Q = I does ("paper" halves it too), W_V = I
    # leaves them as the baseline has them ("paper" is the standard scale for it)
    "k-identity": Rule("W_K = I, scale / 2", REDUCED_WEIGHT_DECAY,
                       {"projection": "k-identity", "attn_scale": "paper"}),
    "v-identity": Rule("W_V = I", REDUCED_WEIGHT_DECAY,
                       {"projection": "v-identity", "attn_scale": "paper"}),
}
RULES: tuple[str, ...] = tuple(RULE_TABLE)
# the main job: each arm at the scale measured best at compare's shape (W_Q = I also with the
# wider MLP), and the paper's exact recipe (halved scale) beside them, labelled
COMPARE_RULES: tuple[str, ...] = ("baseline-tuned", "q-identity-tuned", "q-identity-tuned-wide",
                                  "q-identity")


def rule_named(rule: str) -> Rule:
    require(rule in RULE_TABLE, f"unknown rule {rule!r}; valid rules: {', '.join(RULES)}")
    return RULE_TABLE[rule]


def derive(base: ModelConfig, rule: str, keep: Collection[str] = ()) -> Variant:
    """The variant called `rule`, derived from `base`: the rule's settings, except the model
    keys named in `keep` (those stay as the base has them), then its shape derivation."""
    r = rule_named(rule)
    settings = {k: v for k, v in r.settings.items() if k not in keep}
    model = dataclasses.replace(base, **settings) if settings else base
    if r.shape is not None:  # computed only when asked: narrower's check may refuse the base
        model = r.shape(model)
    return Variant(rule, r.description, model, r.weight_decay)


def compare_variants(base: ModelConfig) -> list[Variant]:
    """The three-way comparison of `qkvlab compare`, derived from a baseline config."""
    return [derive(base, rule) for rule in COMPARE_RULES]


def paper_variants(**overrides) -> list[Variant]:
    """The five GPT-2-small variants of docs/paper.md section 5, as the paper states them."""
    base = ModelConfig(**{**PAPER_SHAPE, **overrides})
    reduced = dataclasses.replace(base, projection="q-identity", attn_scale="paper")
    return [
        Variant("baseline", "W_Q, W_K, W_V", base, BASELINE_WEIGHT_DECAY),
        Variant("q-identity", "W_Q = I, scale / 2", reduced, REDUCED_WEIGHT_DECAY),
        Variant("q-identity-wide", "W_Q = I, MLP 4.5d",
                dataclasses.replace(reduced, mlp_hidden=base.hidden + base.n_embd // 2),
                REDUCED_WEIGHT_DECAY),
        Variant("smaller-mlp", "control: W_Q, MLP 3.5d", dataclasses.replace(base, mlp_ratio=3.5),
                BASELINE_WEIGHT_DECAY),
        Variant("narrower", "control: W_Q, d = 744", dataclasses.replace(base, n_embd=744),
                BASELINE_WEIGHT_DECAY),
    ]
