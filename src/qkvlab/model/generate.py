"""Sampling with a KV cache: temperature, top-k, top-p, seed, stop token."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from qkvlab.model.gpt import GPT

# model -> (parameter versions when compiled, compiled forward); dies with the model
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(model: GPT) -> Callable:
    """`model`'s forward compiled for inference, built on first use and reused after.

    dynamic=True: one graph serves every cache length and prompt length, instead of a
    recompile per decoding position. Inductor's freezing turns the weights into constants
    (on CPU that pre-packs them for oneDNN, which roughly halves a batch-1 decoding step), so
    the graph holds the weights of the moment it was built: it is rebuilt when any parameter
    has changed in place since (an optimizer step, load_state_dict). Dynamo would reuse the
    stale graph for the same module, so a rebuild clears torch.compile's caches first
    (torch.compiler.reset: other compiled functions recompile on their next call). Use under
    no_grad.
    """
    versions = tuple(p._version for p in model.parameters())
    entry = _COMPILED.get(model)
    if entry is None or entry[0] != versions:
        if entry is not None:
            torch.compiler.reset()
        compiled = torch.compile(model, dynamic=True)

        def forward(*args, **kwargs):
            # Every GPT shares one forward code object, and each model needs a few graphs
            # (prefill, one-token decode, no cache, ...): several models in one process (the
            # benchmark's schemes) would pass dynamo's default limit of 8 and fall back to eager.
            with torch._inductor.config.patch(freezing=True), \
                    torch._dynamo.config.patch(recompile_limit=64):
                return compiled(*args, **kwargs)

        entry = _COMPILED[model] = (versions, forward)
    return entry[1]


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
    compile: bool = False,
) -> torch.Tensor:
    """Extend idx (B, T) by up to max_new_tokens tokens.

    With the cache, each new token costs one position of compute. Once the context fills
    block_size, the window slides and the last block_size tokens are recomputed (as without
    the cache). Generation stops early when every row has produced stop_token. compile=True
    runs the model through compiled_forward (a one-time compile of some seconds, kept for
    later calls with the same model).
    """
    if not model.cfg.causal:
        raise ValueError("generation needs a causal model (causal = true)")
    if idx.size(1) == 0:
        raise ValueError("generation needs a prompt of at least one token")
    model.eval()
    forward = compiled_forward(model) if compile else model
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
            logits, _ = forward(idx[:, pos:], cache=cache, start_pos=pos, last_only=True)
            pos = idx.size(1)
        else:
            logits, _ = forward(idx[:, -block:], last_only=True)
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, gen)
        if stop_token is not None:
            nxt = torch.where(done[:, None], torch.full_like(nxt, stop_token), nxt)
            done |= nxt[:, 0] == stop_token
        idx = torch.cat((idx, nxt), dim=1)
        if stop_token is not None and bool(done.all()):
            break
    return idx
