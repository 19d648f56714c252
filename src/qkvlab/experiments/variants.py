"""The paper's model variants (PAPER.md section 5) and the rules that derive them from a base.

The rules, stated once: W_Q = I halves the attention scale (the config default for the scheme)
and lowers weight decay from 0.1 to 2^-5; "reallocated" moves the d^2 saved per layer into the
MLP (hidden + d/2, i.e. 4d -> 4.5d).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
    return dataclasses.replace(base, projection="q-identity", attn_scale=None)


def reallocated(base: ModelConfig) -> ModelConfig:
    """W_Q = I with the d^2 saved per layer given to the MLP: hidden + d/2."""
    return dataclasses.replace(reduced(base), mlp_hidden=base.hidden + base.n_embd // 2)


def compare_variants(base: ModelConfig) -> list[Variant]:
    """The three-way comparison of `qkvlab compare`, derived from a baseline config."""
    return [
        Variant("baseline", "W_Q, W_K, W_V", base, BASELINE_WEIGHT_DECAY),
        Variant("q-identity", "W_Q = I, scale / 2", reduced(base), REDUCED_WEIGHT_DECAY),
        Variant("q-identity-wide", "W_Q = I, MLP + d/2", reallocated(base), REDUCED_WEIGHT_DECAY),
    ]


def paper_variants(**overrides) -> list[Variant]:
    """The five GPT-2-small variants of PAPER.md section 5."""
    base = ModelConfig(**{**PAPER_SHAPE, **overrides})
    return compare_variants(base) + [
        Variant("smaller-mlp", "control: W_Q, MLP 3.5d", dataclasses.replace(base, mlp_ratio=3.5),
                BASELINE_WEIGHT_DECAY),
        Variant("narrower", "control: W_Q, d = 744", dataclasses.replace(base, n_embd=744),
                BASELINE_WEIGHT_DECAY),
    ]
