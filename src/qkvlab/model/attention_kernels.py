"""The eager attention kernel: SDPA's contract in plain batched matmuls.

Kept apart from the model so that it can be timed and tested on its own (benchmarks/
causal_blocks.py swaps `causal_block_rows` here to compare block sizes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_block_rows(n_q: int) -> int:
    """Query rows per block of the causal eager path: at least 256 (below that the blocks'
    extra ops and smaller matmuls cost what the skipped ones save), at most 4 blocks. What the
    blocks buy is measured by benchmarks/causal_blocks.py; the result (small, not resolved at
    the paper shape) is in benchmarks/README.md."""
    return max(256, -(-n_q // 4))


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, causal_block: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in plain batched matmuls, with SDPA's arguments and
    meaning (attn_mask: True = may attend, or an additive float mask; is_causal: the
    top-left-aligned triangle). The scores stay in the matmul dtype (bf16 under autocast), as in
    nanoGPT's and Hugging Face's eager attention.

    Causal attention runs in blocks of `causal_block` query rows (default: causal_block_rows):
    rows s..e-1 see keys 0..e-1 only, so the blocks right of the diagonal, fully masked, are
    never computed, as a flash kernel skips them (with 4 blocks, 6 of the 16 score tiles)."""
    *batch, n_q, d_k = q.shape
    if enable_gqa:
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    n_k = k.size(-2)
    scale = d_k ** -0.5 if scale is None else scale
    q3, k3 = q.reshape(-1, n_q, d_k), k.reshape(-1, n_k, d_k)
    v3 = v.reshape(-1, n_k, v.size(-1))
    # scale * q k^T + mask in one op (baddbmm): no separate passes over the T x T scores to
    # scale and mask them, forward or backward
    if is_causal:
        bias = torch.full((n_q, n_k), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        block = causal_block or causal_block_rows(n_q)
        ys = []
        # split, not slices, for the queries: one cat in the backward instead of one
        # zero-filled full-size gradient per block; the last block takes the keys whole
        for s, q_block in zip(range(0, n_q, block), q3.split(block, dim=1), strict=True):
            e = s + q_block.size(1)
            k_seen, v_seen = (k3, v3) if e >= n_k else (k3[:, :e], v3[:, :e])
            scores = torch.baddbmm(bias[s:e, :e], q_block, k_seen.transpose(1, 2), alpha=scale)
            ys.append(_softmax_times_values(scores, v_seen, dropout_p))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
    elif attn_mask is not None and attn_mask.dim() > 2:  # a per-batch mask: added afterwards
        att = (torch.bmm(q3, k3.transpose(1, 2)) * scale).view(*batch, n_q, n_k)
        y = _softmax_times_values((att + _additive(attn_mask, q)).view(-1, n_q, n_k), v3,
                                  dropout_p)
    else:
        bias = torch.zeros((), dtype=q.dtype, device=q.device) if attn_mask is None \
            else _additive(attn_mask, q)
        y = _softmax_times_values(torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scale), v3,
                                  dropout_p)
    return y.view(*batch, n_q, v.size(-1))


def _additive(attn_mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """SDPA's mask as a bias to add to the scores: a boolean mask (True = may attend) becomes
    0 / -inf, a float mask is one already."""
    if attn_mask.dtype != torch.bool:
        return attn_mask.to(q.dtype)
    bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    return bias.masked_fill(~attn_mask, float("-inf"))


def _softmax_times_values(scores: torch.Tensor, v3: torch.Tensor, dropout_p: float
                          ) -> torch.Tensor:
    att = torch.softmax(scores, dim=-1)
    if dropout_p:
        att = F.dropout(att, dropout_p)
    return torch.bmm(att, v3)
