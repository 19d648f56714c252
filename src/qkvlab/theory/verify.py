"""`qkvlab verify`: every statement of docs/paper.md sections 1-4, checked numerically in float64.

Each row is one statement on random weights: exact statements must match to rounding error,
obstructions must show an error far above it. The two thresholds are a decade-wide gap apart
from what the checks actually produce (~1e-14 vs >= 1e-2), so PASS/FAIL is not a close call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkvlab.model.attention_layout import Projections
from qkvlab.theory import lemma, limits, relu_skip, rope
from qkvlab.theory.common import random_model

EXACT_TOL = 1e-9  # exact: max |diff| <= this (float64 rounding gives ~1e-14)
OBSTRUCTION_TOL = 1e-4  # obstruction: max |diff| >= this


@dataclass
class CheckResult:
    """One statement, its hypotheses and the measured max absolute output difference."""

    section: str
    statement: str
    hypotheses: str
    value: float
    expect: str  # "exact" or "obstruction"

    @property
    def tol(self) -> float:
        return EXACT_TOL if self.expect == "exact" else OBSTRUCTION_TOL

    @property
    def passed(self) -> bool:
        if self.value != self.value:  # NaN never passes
            return False
        return self.value <= self.tol if self.expect == "exact" else self.value >= self.tol

    @property
    def criterion(self) -> str:
        return f"<= {self.tol:.0e}" if self.expect == "exact" else f">= {self.tol:.0e}"


def _model_error(seed: int, to: str = "q-identity", exact: bool = True,
                 zero_bias: str | None = None, **cfg) -> float:
    model = random_model(limits.small_config(**cfg), seed)
    if zero_bias is not None:  # an identity query cannot reproduce b_Q (section 2 needs b_Q=0)
        for blk in model.blocks:
            bias = blk.attn.projections().bias(zero_bias)
            blk.attn.load_projections(Projections(**{f"b_{zero_bias}": torch.zeros_like(bias)}))
    return limits.conversion_error(model, to, seed=seed, exact=exact).error


def _relu_exact(seed: int) -> float:
    W1, W2, _ = relu_skip.positive_example(4, 10, seed, k=6)
    S = relu_skip.absorbable(W1, W2)
    if S is None:
        return float("inf")
    A1, A2 = relu_skip.absorb(W1, W2, S)
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return float((relu_skip.mlp(A1, A2, x, skip=False)
                  - relu_skip.mlp(W1, W2, x, skip=True)).abs().max())


def _relu_generic_fit(seed: int) -> float:
    W1, W2 = relu_skip.generic_example(4, 6, seed)
    if relu_skip.absorbable(W1, W2) is not None:  # measure-zero event; would be a bug
        return 0.0
    return relu_skip.same_width_fit(W1, W2, steps=300, n=1024, seed=seed).max_abs_error


def _relu_widen(seed: int) -> float:
    W1, W2 = relu_skip.generic_example(4, 6, seed)
    V1, V2 = relu_skip.widen_exact(W1, W2)
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return float((relu_skip.mlp(V1, V2, x, skip=False)
                  - relu_skip.mlp(W1, W2, x, skip=True)).abs().max())


def _checks(seed: int) -> list[tuple[str, str, str, str, Callable[[], float]]]:
    s = seed
    E, O = "exact", "obstruction"
    return [
        ("1", "MHA(XT; T^-1 W) = MHA(X; W)", "random invertible T, causal mask", E,
         lambda: lemma.invariance_error(causal=True, seed=s)),
        ("1", "MHA(XT; T^-1 W) = MHA(X; W)", "random invertible T, bidirectional mask", E,
         lambda: lemma.invariance_error(causal=False, seed=s)),
        ("1", "MHA(XT; T^-1 W) = MHA(X; W)", "GQA (2 kv heads for 4), causal", E,
         lambda: lemma.invariance_error(n_kv_head=2, seed=s)),
        ("1", "Q = I: W_K' = W_Q^-1 W_K, W_V' = W_Q^-1 W_V, X' = X W_Q", "W_Q invertible", E,
         lambda: lemma.identity_error("q", seed=s)),
        ("1", "Q = I under GQA", "W_Q square; K, V with 2 kv heads", E,
         lambda: lemma.identity_error("q", n_kv_head=2, seed=s)),
        ("1", "K = I: W_Q' = W_K^-1 W_Q, W_V' = W_K^-1 W_V", "W_K invertible, bidirectional",
         E, lambda: lemma.identity_error("k", causal=False, seed=s)),
        ("1", "V = I: W_Q' = W_V^-1 W_Q, W_K' = W_V^-1 W_K", "W_V invertible", E,
         lambda: lemma.identity_error("v", seed=s)),
        ("2.1", "single layer, no skip: embeddings absorb W_Q",
         "L=1, no norm, tied head (W_2 carries T^-T)", E,
         lambda: _model_error(s, n_layer=1, residual="none", tie_embeddings=True)),
        ("2.1", "single layer with attention skip: W_O W_Q, W_Q^-1 W_1",
         "L=1, X + MHA(X), no norm", E,
         lambda: _model_error(s, n_layer=1, residual="attention")),
        ("2.1", "single layer, full skips: head absorbs W_Q^-1",
         "L=1, skips around attn and MLP, untied", E,
         lambda: _model_error(s, n_layer=1, residual="full")),
        ("2.2", "L layers, skip around attention only", "L=3, no norm, biases (b_Q = 0)", E,
         lambda: _model_error(s, n_layer=3, residual="attention", bias=True, zero_bias="q")),
        ("2.2", "L layers without skips", "L=3, no norm, tied head", E,
         lambda: _model_error(s, n_layer=3, residual="none", tie_embeddings=True)),
        ("2.2", "K = I conversion (b_K dropped: softmax shift)", "L=3, attention skips, biases",
         E, lambda: _model_error(s, "k-identity", n_layer=3, residual="attention", bias=True)),
        ("2.2", "V = I conversion (b_V folded into b_O)", "L=3, attention skips, biases", E,
         lambda: _model_error(s, "v-identity", n_layer=3, residual="attention", bias=True)),
        ("2.2", "RoPE passes through (it acts after projections)", "L=3, attention skips, RoPE",
         E, lambda: _model_error(s, n_layer=3, residual="attention", positions="rope")),
        ("2.3", "full skips, shared weights: one T for the stream",
         "L=3, ALBERT-style sharing, untied head", E,
         lambda: _model_error(s, n_layer=3, residual="full", share_layers=True)),
        ("2.3", "full skips without sharing: natural conversion", "L=3, per-layer W_Q", O,
         lambda: limits.full_skip_limit(seed=s, n_layer=3).error),
        ("2.4", "tied head on a residual path, orthogonal W_Q", "shared full skips, tied", E,
         lambda: limits.tied_limit(seed=s, orthogonal=True).error),
        ("2.4", "tied head on a residual path, generic W_Q", "shared full skips, tied", O,
         lambda: limits.tied_limit(seed=s, orthogonal=False).error),
        ("3", "RMSNorm obstructs the conversion", "pre-norm, generic W_Q and gains", O,
         lambda: limits.norm_limit("rmsnorm", "generic", seed=s).error),
        ("3", "RMSNorm: exact again for orthogonal W_Q", "W_Q orthogonal, gamma_1 = 1", E,
         lambda: limits.norm_limit("rmsnorm", "orthogonal", seed=s).error),
        ("3", "RMSNorm: gains T diag(gamma') = diag(gamma) W_Q",
         "W_Q = diag(gamma)^-1 T diag(c), T orthogonal", E,
         lambda: limits.norm_limit("rmsnorm", "orthogonal", seed=s, scaled_gains=True).error),
        ("3", "LayerNorm obstructs the conversion", "pre-norm, generic W_Q and gains", O,
         lambda: limits.norm_limit("layernorm", "generic", seed=s).error),
        ("3", "LayerNorm: orthogonal W_Q alone is not enough", "W_Q orthogonal, moves 1", O,
         lambda: limits.norm_limit("layernorm", "orthogonal", seed=s).error),
        ("3", "LayerNorm: exact for orthogonal W_Q keeping 1", "W_Q orthogonal, W_Q 1 = 1", E,
         lambda: limits.norm_limit("layernorm", "orthogonal-ones", seed=s).error),
        ("4", "ReLU skip absorbed at width m via index set S",
         "W_2[:, S] W_1[S, :] = -I (d=4, m=10)", E, lambda: _relu_exact(s)),
        ("4", "generic ReLU skip: best same-width skip-free fit", "generic W_1, W_2 (d=4, m=6)",
         O, lambda: _relu_generic_fit(s)),
        ("4", "width m + 2d represents x + W_2 relu(W_1 x)", "relu(x) - relu(-x) = x", E,
         lambda: _relu_widen(s)),
    ]


def _rope_checks(seed: int) -> list[tuple[str, str, str, str, Callable[[], float]]]:
    """Folding one head's W_Q into its keys (what a retrofit does) under RoPE: docs/theory.md,
    "W_Q under RoPE"."""
    s = seed
    return [
        ("RoPE", "fold W_Q into W_K: q = x, k = y W_K W_Q^T", "one head, no positions", "exact",
         lambda: rope.fold_error("no-rope", seed=s)),
        ("RoPE", "fold W_Q into W_K under RoPE", "generic W_Q (d_k = 8)", "obstruction",
         lambda: rope.fold_error("generic", seed=s)),
        ("RoPE", "fold under RoPE, W_Q commuting with the rotations",
         "2x2 rotation-scaling per RoPE pair", "exact",
         lambda: rope.fold_error("commuting", seed=s)),
    ]


def run_checks(seed: int = 0) -> list[CheckResult]:
    """Run every check of the table (a few seconds on 2 CPU cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny float64 problems: threading only adds overhead
    try:
        out = []
        for section, statement, hyp, expect, fn in _checks(seed) + _rope_checks(seed):
            out.append(CheckResult(section, statement, hyp, float(fn()), expect))
        return out
    finally:
        torch.set_num_threads(threads)
