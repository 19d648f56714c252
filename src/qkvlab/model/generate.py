"""Sampling with a KV cache: temperature, top-k, top-p, seed, stop token."""

from __future__ import annotations

import torch

from qkvlab.model.gpt import GPT


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B, 1) from last-position logits (B, V). temperature 0 means greedy."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Extend idx (B, T) by up to max_new_tokens tokens.

    With the cache, each new token costs one position of compute. Once the context fills
    block_size, the window slides and the last block_size tokens are recomputed (as without
    the cache). Generation stops early when every row has produced stop_token.
    """
    if not model.cfg.causal:
        raise ValueError("generation needs a causal model (causal = true)")
    if idx.size(1) == 0:
        raise ValueError("generation needs a prompt of at least one token")
    model.eval()
    block = model.cfg.block_size
    gen = None
    if seed is not None:
        gen = torch.Generator(device=idx.device)
        gen.manual_seed(seed)
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    cache, pos = None, 0  # pos: how many tokens of idx the cache holds
    for _ in range(max_new_tokens):
        if use_cache and idx.size(1) <= block:
            if cache is None:
                cache, pos = model.new_cache(idx.size(0)), 0
            logits, _ = model(idx[:, pos:], cache=cache, start_pos=pos, last_only=True)
            pos = idx.size(1)
        else:
            logits, _ = model(idx[:, -block:], last_only=True)
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, gen)
        if stop_token is not None:
            nxt = torch.where(done[:, None], torch.full_like(nxt, stop_token), nxt)
            done |= nxt[:, 0] == stop_token
        idx = torch.cat((idx, nxt), dim=1)
        if stop_token is not None and bool(done.all()):
            break
    return idx
