"""Log-likelihoods of continuations under a qkvlab GPT, as lm-eval's hf backend computes them.

A request is (context ids, continuation ids). The model reads the last block_size + 1 tokens of
context + continuation minus the final one (left-truncation), and the continuation's loglik is
the sum of the log-softmax at its tokens; `greedy` says whether the argmax at every one of those
positions is the continuation's token.

A continuation longer than block_size fits no single window (lm-eval's truncation cannot score
it): it is scored in consecutive windows of at most block_size targets, from its end backwards,
as lm-eval's rolling log-likelihood scores a long text: each token conditioned on up to
block_size tokens before it. Where a continuation fits, this is the one window above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qkvlab.data.tokenizer import Tokenizer
from qkvlab.errors import QkvlabError
from qkvlab.run.device import autocast

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


@dataclass(frozen=True)
class Scored:
    loglik: float
    greedy: bool


def encode_pair(tok: Tokenizer, context: str, continuation: str) -> Pair:
    """lm-eval's split: trailing spaces of the context move to the continuation, the whole text
    is encoded and the context's tokens cut off its front (BPE merges across the seam)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    ctx = tok.encode(context)
    return ctx, tok.encode(context + continuation)[len(ctx):]


def encode_or_skip(tok: Tokenizer, context: str, continuation: str) -> Pair | str:
    """The pair, or why it cannot be scored (in words, for the skip count)."""
    try:
        ctx, cont = encode_pair(tok, context, continuation)
    except QkvlabError:  # the char tokenizer lacks a character of the text
        return "characters outside the model's vocabulary"
    if not ctx or not cont:
        return "an empty context or continuation after tokenization"
    return ctx, cont


def window(pair: Pair, block_size: int) -> Pair:
    """(input ids, target ids) of a continuation that fits: the targets are the continuation,
    predicted at the last len(continuation) input positions."""
    seq = (pair[0] + pair[1])[-(block_size + 1):]
    return seq[:-1], seq[-len(pair[1]):]


def windows(pair: Pair, block_size: int) -> list[Pair]:
    """The windows that score the continuation: one when it fits in block_size, else one per
    block_size-long piece counted from its end (the first piece the shortest)."""
    ctx, cont = pair
    seq, ends = ctx + cont, range(len(cont), 0, -block_size)
    return [window((seq[:len(ctx) + end - min(block_size, end)],
                    seq[len(ctx) + end - min(block_size, end):len(ctx) + end]), block_size)
            for end in reversed(ends)]


@torch.no_grad()
def score(model: torch.nn.Module, pairs: Sequence[Pair], *, batch_size: int,
          device: torch.device, dtype: str = "fp32") -> list[Scored]:
    """Score every pair, `batch_size` at a time (longest first, so a batch pads little)."""
    block = model.cfg.block_size
    flat, owner = [], []  # every window, and the pair it scores
    for i, p in enumerate(pairs):
        for w in windows(p, block):
            flat.append(w)
            owner.append(i)
    order = sorted(range(len(flat)), key=lambda i: -len(flat[i][0]))
    parts: list[list[Scored]] = [[] for _ in pairs]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        for i, s in zip(chunk, _score_batch(model, [flat[i] for i in chunk], device, dtype),
                        strict=True):
            parts[owner[i]].append(s)
    return [Scored(sum(s.loglik for s in ss), all(s.greedy for s in ss)) for ss in parts]


def _score_batch(model: torch.nn.Module, windows: list[Pair], device: torch.device,
                 dtype: str) -> list[Scored]:
    # right padding: a causal model's outputs before the padding do not see it
    x = torch.zeros(len(windows), max(len(w[0]) for w in windows), dtype=torch.long)
    rows, cols, targets = [], [], []
    for b, (inp, tgt) in enumerate(windows):
        x[b, :len(inp)] = torch.tensor(inp)
        rows += [b] * len(tgt)
        cols += range(len(inp) - len(tgt), len(inp))
        targets += tgt
    with autocast(device, dtype):
        h = model.hidden_states(x.to(device))
        # the head only where a target is: V-wide logits at every position are the big tensor
        logits = model.head(h[torch.tensor(rows, device=h.device),
                                 torch.tensor(cols, device=h.device)])
    logp = torch.log_softmax(logits.float(), dim=-1)
    t = torch.tensor(targets, device=logp.device)
    lls = logp.gather(1, t[:, None])[:, 0].double().tolist()
    hits = (logp.argmax(dim=-1) == t).tolist()
    out, at = [], 0
    for _, tgt in windows:
        n = len(tgt)
        out.append(Scored(sum(lls[at:at + n]), all(hits[at:at + n])))
        at += n
    return out
