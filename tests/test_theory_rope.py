"""W_Q under RoPE: folding a head's query map into its keys is exact without positions and for
maps that commute with the rotations, and an O(1) obstruction for a generic W_Q."""

from __future__ import annotations

import torch

from qkvlab.model.gpt import apply_rope
from qkvlab.theory.rope import commuting_basis, fold_error, rope_angles


def test_fold_is_exact_without_positions_and_for_commuting_maps():
    for seed in range(3):
        assert fold_error("no-rope", seed=seed) < 1e-12
        assert fold_error("commuting", seed=seed) < 1e-12
        assert fold_error("generic", seed=seed) > 1e-2


def test_the_basis_commutes_with_every_rotation():
    dk, length = 8, 12
    cos, sin = rope_angles(dk, length)
    x = torch.randn(length, dk, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for w in commuting_basis(dk):
        rotated_then_mapped = apply_rope(x[None, None], cos, sin)[0, 0] @ w
        mapped_then_rotated = apply_rope((x @ w)[None, None], cos, sin)[0, 0]
        torch.testing.assert_close(rotated_then_mapped, mapped_then_rotated)
    assert torch.linalg.matrix_rank(commuting_basis(dk).reshape(dk, -1)) == dk
