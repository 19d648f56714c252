"""The attention scale at initialisation: how large a model's first logits are.

The "matched" rule (model/config.py, derived in docs/theory.md) is meant to give an identity
query the baseline's initial logit spread at any width; `initial_logit_std` measures that
spread, so the rule is checked rather than assumed.
"""

from __future__ import annotations

import torch

from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT


@torch.no_grad()
def initial_logit_std(cfg: ModelConfig, seed: int = 0, batch: int = 4, length: int = 128
                      ) -> float:
    """Std of the first layer's attention logits q k^T * scale of a freshly initialised model
    (float32, uniformly random tokens)."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    length = min(length, cfg.block_size)
    idx = torch.randint(cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(
        seed + 1))
    x = model.wte(idx)
    if model.wpe is not None:
        x = x + model.wpe(torch.arange(length))
    block = model.blocks[0]
    rope = (model.rope_cos, model.rope_sin) if cfg.positions == "rope" else None
    q, k, _ = block.attn.heads(block.norm1(x), rope)
    k = k.repeat_interleave(cfg.n_head // cfg.kv_heads, dim=1)
    return float((q @ k.transpose(-2, -1) * cfg.scale).std())
