"""The paper's model variants (docs/paper.md section 5) and the rules that derive them from a base.

The rules, stated once: W_Q = I halves the attention scale (the config default for the scheme)
and lowers weight decay from 0.1 to 2^-5; "reallocated" moves the d^2 saved per layer into the
MLP (hidden + d/2, i.e. 4d -> 4.5d).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qkvlab.errors import QkvlabError
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


def reduced(base: ModelConfig) -> ModelConfig:
    """W_Q = I with the scheme's default (halved) scale."""
    return dataclasses.replace(base, projection="q-identity", attn_scale="paper")


def saved_hidden(base: ModelConfig) -> int:
    """MLP hidden units that hold the d^2 weights W_Q = I saves per layer: d/2 for the GELU
    MLP's two matrices, d/3 (rounded) for SwiGLU's three."""
    return round(base.n_embd / base.mlp_matrices)


def reallocated(base: ModelConfig) -> ModelConfig:
    """W_Q = I with the d^2 saved per layer given to the MLP: hidden + d/2 (SwiGLU: + d/3)."""
    return dataclasses.replace(reduced(base), mlp_hidden=base.hidden + saved_hidden(base))


def compare_variants(base: ModelConfig) -> list[Variant]:
    """The three-way comparison of `qkvlab compare`, derived from a baseline config."""
    return [
        Variant("baseline", "W_Q, W_K, W_V", base, BASELINE_WEIGHT_DECAY),
        Variant("q-identity", "W_Q = I, scale / 2", reduced(base), REDUCED_WEIGHT_DECAY),
        Variant("q-identity-wide", "W_Q = I, MLP + d/2", reallocated(base), REDUCED_WEIGHT_DECAY),
    ]


def paper_variants(**overrides) -> list[Variant]:
    """The five GPT-2-small variants of docs/paper.md section 5."""
    base = ModelConfig(**{**PAPER_SHAPE, **overrides})
    return compare_variants(base) + [
        Variant("smaller-mlp", "control: W_Q, MLP 3.5d", dataclasses.replace(base, mlp_ratio=3.5),
                BASELINE_WEIGHT_DECAY),
        Variant("narrower", "control: W_Q, d = 744", dataclasses.replace(base, n_embd=744),
                BASELINE_WEIGHT_DECAY),
    ]


# ---- the rules as named derivations, for experiment specs --------------------------------
def smaller_mlp(base: ModelConfig) -> ModelConfig:
    """Control: W_Q kept, the MLP shrunk by the d^2 per layer W_Q = I saves (hidden - d/2).

    Said as a ratio when the base says one (4d -> 3.5d), so the paper's base gives exactly the
    control of `paper_variants`.
    """
    if base.mlp_hidden is None and base.mlp == "gelu":
        return dataclasses.replace(base, mlp_ratio=base.mlp_ratio - 0.5)
    return dataclasses.replace(base, mlp_hidden=base.hidden - saved_hidden(base))


def narrower(base: ModelConfig) -> ModelConfig:
    """Control: W_Q kept, every head 2 dimensions narrower (the paper's d = 768 -> 744)."""
    if base.head_dim is not None:
        raise QkvlabError("rule narrower shrinks n_embd and derives the head size from it: unset "
                          "model.head_dim or give the variant an explicit n_embd instead")
    return dataclasses.replace(base, n_embd=base.n_embd - 2 * base.n_head)


def nonlinear_query(base: ModelConfig) -> ModelConfig:
    """docs/paper.md section 6: Q(X) = (X + f(X)) / 2, keys and values linear, the usual scale."""
    return dataclasses.replace(base, projection="nonlinear-q", attn_scale="paper")


def derive(base: ModelConfig, rule: str) -> Variant:
    """The variant called `rule`, derived from `base` by the rules above.

    The names are those of `compare_variants` and `paper_variants` (applied to the paper's base
    they give exactly its five variants), plus "nonlinear-q" (weight decay 0.1, as the paper's
    best nonlinear-query run).
    """
    variants = {v.name: v for v in compare_variants(base)}
    variants["smaller-mlp"] = Variant("smaller-mlp", "control: W_Q, MLP - d/2", smaller_mlp(base),
                                      BASELINE_WEIGHT_DECAY)
    variants["nonlinear-q"] = Variant("nonlinear-q", "Q = (X + f(X)) / 2",
                                      nonlinear_query(base), BASELINE_WEIGHT_DECAY)
    if rule == "narrower":  # computed only when asked: its shape check may refuse the base
        return Variant("narrower", "control: W_Q, head size - 2", narrower(base),
                       BASELINE_WEIGHT_DECAY)
    if rule not in variants:
        raise QkvlabError(f"unknown rule {rule!r}; valid rules: {', '.join(RULES)}")
    return variants[rule]


RULES: tuple[str, ...] = ("baseline", "q-identity", "q-identity-wide", "smaller-mlp", "narrower",
                          "nonlinear-q")
