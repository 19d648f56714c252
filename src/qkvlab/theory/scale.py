"""The attention scale: how large a model's logits are at initialisation and after training.

The "matched" rule (model/config.py, derived in docs/theory.md) is meant to give an identity
query the baseline's initial logit spread at any width; `initial_logit_std` measures that
spread, so the rule is checked rather than assumed. `attention_stats` measures the logit spread
and the attention entropy of any model, layer by layer: whether a trained W_Q = I model
attends as sharply as the baseline.
"""

from __future__ import annotations

import math

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
    return float(block.attn.scores(block.norm1(x), rope, masked=False).std())


@torch.no_grad()
def attention_stats(model: GPT, idx: torch.Tensor) -> list[dict[str, float]]:
    """Per layer, how sharp a model's attention is on token ids idx (B, T), in float32:
    `logit_std`, the std of the logits q k^T * scale (learned per-head gains included) over
    the pairs a query may attend to, and `entropy`, the mean entropy of the attention rows in
    nats. What an identity query changes is how large the logits can grow, so these say
    whether a trained W_Q = I model attends as sharply as the baseline."""
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("attention_stats needs a float32 model (model.float())")
    inputs, was_training = [], model.training
    # the attention's input (norm1's output) and the RoPE tables, as each layer sees them
    hooks = [block.attn.register_forward_pre_hook(
        lambda _m, args: inputs.append((args[0], args[1] if len(args) > 1 else None)))
        for _, block in model.layers()]
    try:
        model.eval()(idx)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    out = []
    for (_, block), (h, rope) in zip(model.layers(), inputs, strict=True):
        logits = block.attn.scores(h, rope)
        allowed = block.attn.allowed(idx.shape[1], logits.device)
        p = logits.softmax(-1)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        out.append({"logit_std": float(logits[..., allowed].std()),
                    "entropy": float(entropy.mean())})
    return out


def uniform_entropy(length: int, causal: bool = True) -> float:
    """The mean row entropy of attention spread evenly over what each query may see: the
    ceiling `attention_stats`' entropy is read against."""
    if not causal:
        return math.log(length)
    return math.fsum(math.log(i + 1) for i in range(length)) / length
