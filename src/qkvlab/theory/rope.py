"""W_Q under RoPE: moving the query map into the keys, and when that stays exact.

Without positions a head's logits x W_Q (y W_K)^T equal x (y W_K W_Q^T)^T: W_Q folds into the
keys and the query becomes the identity. RoPE rotates q and k after their projections, by the
angle of their own positions: R_m (W_Q^T x) . R_n (W_K^T y) = x^T W_Q R_{n-m} W_K^T y, and the
fold needs W_Q R = R W_Q for every rotation R that RoPE uses. A generic W_Q does not commute
with them: `fold_error(kind="generic")` measures how far the folded head is from the original
(an obstruction). A W_Q made of 2 x 2 rotation-scalings [[a, b], [-b, a]] on each of RoPE's
channel pairs (i, i + d_k/2) does commute: `fold_error(kind="commuting")` is rounding error.

(A change of basis of the whole residual stream, section 1's lemma, is another matter: there
q' = R(X W_Q) is exactly R applied to the projected query, and RoPE changes nothing. The
obstruction here is specific to folding one head's W_Q into its own keys, as a retrofit does.)
"""

from __future__ import annotations

import math

import torch

from qkvlab.model.gpt import apply_rope

F64 = torch.float64
KINDS = ("generic", "commuting", "no-rope")


def rope_angles(d_head: int, length: int, base: float = 10000.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, d_head/2) of RoPE's angles, in float64."""
    half = d_head // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=F64) / half))
    angles = torch.outer(torch.arange(length, dtype=F64), inv_freq)
    return angles.cos(), angles.sin()


def commuting_basis(d_head: int) -> torch.Tensor:
    """(d_head, d_head, d_head): a basis of the maps (column convention q = x W) that commute
    with every RoPE rotation, which turns each channel pair (i, i + half) by its own frequency:
    per pair, the identity and the quarter turn of that pair's plane."""
    half = d_head // 2
    basis = torch.zeros(d_head, d_head, d_head, dtype=F64)
    for j in range(half):
        basis[2 * j, j, j] = basis[2 * j, j + half, j + half] = 1.0
        basis[2 * j + 1, j, j + half], basis[2 * j + 1, j + half, j] = 1.0, -1.0
    return basis


def commuting_query(d_head: int, gen: torch.Generator) -> torch.Tensor:
    """A random W_Q in that family: a rotation-scaling [[a, b], [-b, a]] on each channel pair."""
    half = d_head // 2
    a = 0.5 + torch.rand(half, generator=gen, dtype=F64)
    b = torch.randn(half, generator=gen, dtype=F64)
    coef = torch.stack([a, b], dim=1).reshape(-1)  # a_0, b_0, a_1, b_1, ... as the basis
    return torch.einsum("m,mij->ij", coef, commuting_basis(d_head))


def _head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
          ) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def fold_error(kind: str = "generic", d_head: int = 8, length: int = 16, seed: int = 0) -> float:
    """max |head(X; W_Q, W_K, W_V) - head(X; I, W_K W_Q^T, W_V)| for one causal head with RoPE
    (kind "generic": a random W_Q; "commuting": a rotation-scaling per RoPE pair) or without
    positions (kind "no-rope", the exact case the paper proves)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, d_head, generator=gen, dtype=F64)
    w_k, w_v = (torch.randn(d_head, d_head, generator=gen, dtype=F64) / math.sqrt(d_head)
                for _ in range(2))
    w_q = commuting_query(d_head, gen) if kind == "commuting" else \
        torch.randn(d_head, d_head, generator=gen, dtype=F64) / math.sqrt(d_head)
    cos, sin = rope_angles(d_head, length)

    def rot(t: torch.Tensor) -> torch.Tensor:
        return t if kind == "no-rope" else apply_rope(t[None, None], cos, sin)[0, 0]

    original = _head(rot(x @ w_q), rot(x @ w_k), x @ w_v)
    folded = _head(rot(x), rot(x @ w_k @ w_q.T), x @ w_v)
    return float((original - folded).abs().max())
