"""Measured limits: where no exact conversion exists, apply the best available one and measure.

Each function builds a small float64 model with generic random weights (optionally with the
special structure under which the theorem holds again), converts it with `approximate_convert`
and returns the max absolute logit difference on random tokens. Obstructions show errors of
order 1e-2..1e1; the special cases come back to rounding error (~1e-14).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkvlab.errors import QkvlabError
from qkvlab.model.attention_layout import Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.theory.common import (
    generator,
    max_logit_diff,
    random_model,
    random_orthogonal,
    random_tokens,
)
from qkvlab.theory.convert import ConversionReport, approximate_convert, convert

F64 = torch.float64
NORM_CASES = ("generic", "orthogonal", "orthogonal-ones")


@dataclass
class LimitResult:
    """Output error of a conversion and the report saying which hypotheses failed."""

    error: float  # max |logits - logits'| in float64
    report: ConversionReport


def small_config(**overrides) -> ModelConfig:
    """A tiny model shape for the checks (d=16, 4 heads, ctx 12, vocab 32); override freely."""
    base = dict(n_layer=2, n_head=4, n_embd=16, block_size=12, vocab_size=32, mlp_hidden=32,
                norm="none", residual="attention", positions="learned", tie_embeddings=False,
                bias=False)
    base.update(overrides)
    return ModelConfig(**base)


def set_projection_(model: GPT, which: str, mats: list[torch.Tensor]) -> None:
    """Set W_X (paper convention, d x d) of every distinct block; which in 'q', 'k', 'v'."""
    if len(mats) != len(model.blocks):
        raise QkvlabError(f"need {len(model.blocks)} matrices (one per distinct block), "
                          f"got {len(mats)}")
    for blk, m in zip(model.blocks, mats, strict=True):
        shape = blk.attn.layout.shape(which)  # (out, in): the paper's W_X is its transpose
        if shape is None or m.shape != shape[::-1]:
            want = f"{shape[1]} x {shape[0]}" if shape else "absent (an identity)"
            raise QkvlabError(f"W_{which.upper()} must be {want}, got {tuple(m.shape)}")
        blk.attn.load_projections(Projections(**{f"w_{which}": m.T}))


def zero_query_bias_(model: GPT) -> GPT:
    """Set b_Q = 0 in every block (an identity query cannot reproduce a query bias)."""
    for blk in model.blocks:
        b_q = blk.attn.projections().b_q
        if b_q is not None:
            blk.attn.load_projections(Projections(b_q=torch.zeros_like(b_q)))
    return model


def conversion_error(model: GPT, to: str = "q-identity", *, seed: int = 0,
                     exact: bool = False) -> LimitResult:
    """Convert (exactly, or best-available when exact=False) and measure max |logit diff|."""
    new, report = (convert if exact else approximate_convert)(model, to)
    idx = random_tokens(model.cfg, seed, batch=3)
    return LimitResult(max_logit_diff(model, new, idx), report)


def norm_limit(norm: str, case: str = "generic", *, seed: int = 0, n_layer: int = 2,
               share_layers: bool = True, tie_embeddings: bool = False,
               scaled_gains: bool = False, **shape) -> LimitResult:
    """Section 3 on a pre-norm GPT layout (full skips; shared weights so the norm is the only
    obstruction). case: 'generic' W_Q; 'orthogonal' W_Q (exact for RMSNorm, not LayerNorm);
    'orthogonal-ones' orthogonal and fixing the all-ones direction (exact for both).

    With scaled_gains the first norm's gain is generic too and W_Q = diag(gamma)^-1 T diag(c)
    with T orthogonal, the general form T diag(gamma') = diag(gamma) W_Q of the condition.
    `shape` overrides the model shape (n_embd, n_head, mlp_hidden, ...).
    """
    if norm not in ("layernorm", "rmsnorm"):
        raise QkvlabError(f"norm must be layernorm or rmsnorm, got {norm!r}")
    if case not in NORM_CASES:
        raise QkvlabError(f"case must be one of {', '.join(NORM_CASES)}, got {case!r}")
    cfg = small_config(**{**shape, "norm": norm, "residual": "full", "n_layer": n_layer,
                          "share_layers": share_layers, "tie_embeddings": tie_embeddings})
    model = zero_query_bias_(random_model(cfg, seed))
    if case != "generic":
        d = cfg.n_embd
        mats = []
        for i, blk in enumerate(model.blocks):
            T = random_orthogonal(d, seed + 100 + i, keep_ones=case == "orthogonal-ones")
            if scaled_gains:
                gamma = blk.norm1.weight.detach().to(F64)
                c = 0.5 + torch.rand(d, generator=generator(seed + 200 + i), dtype=F64)
                mats.append(T * c / gamma[:, None])  # diag(1/gamma) T diag(c)
            else:
                with torch.no_grad():
                    blk.norm1.weight.fill_(1.0)
                mats.append(T)
        set_projection_(model, "q", mats)
        if tie_embeddings:
            with torch.no_grad():
                model.norm_f.weight.fill_(1.0)  # a tied head needs T^T G_f T diagonal
    return conversion_error(model, "q-identity", seed=seed)


def full_skip_limit(*, seed: int = 0, n_layer: int = 3, to: str = "q-identity",
                    **shape) -> LimitResult:
    """Full skips without shared weights, no norm: the section 2.2 recipe applied anyway
    (W_2 of layer l carries T_{l+1}, but the skip still carries T_l)."""
    cfg = small_config(**{**shape, "residual": "full", "n_layer": n_layer,
                          "share_layers": False})
    model = random_model(cfg, seed)
    if to == "q-identity":
        zero_query_bias_(model)
    return conversion_error(model, to, seed=seed)


def tied_limit(*, seed: int = 0, orthogonal: bool = False, n_layer: int = 2) -> LimitResult:
    """Section 2.4: tied embeddings on a residual path (shared full skips): exact iff W_Q is
    orthogonal."""
    cfg = small_config(residual="full", n_layer=n_layer, share_layers=True, tie_embeddings=True)
    model = zero_query_bias_(random_model(cfg, seed))
    if orthogonal:
        set_projection_(model, "q", [random_orthogonal(cfg.n_embd, seed + 300)])
    return conversion_error(model, "q-identity", seed=seed)
