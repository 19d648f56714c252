"""The reparametrization lemma (docs/paper.md section 1) on the model's own Attention module.

    MHA(X T; T^-1 W_Q, T^-1 W_K, T^-1 W_V, W_O) == MHA(X; W_Q, W_K, W_V, W_O)

and its corollary: with T = W_X the X projection is the identity. Checked on `Attention`
(the code the models run), in float64, for causal and bidirectional masks and under GQA.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

from qkvlab.errors import QkvlabError
from qkvlab.model.attention_layout import Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import Attention
from qkvlab.theory.common import generator, randomize_

F64 = torch.float64


def _attention(cfg: ModelConfig, seed: int) -> Attention:
    att = Attention(cfg).to(F64).eval()
    return randomize_(att, seed)


def _cfg(n_embd: int, n_head: int, n_kv_head: int | None, causal: bool, length: int,
         **kw) -> ModelConfig:
    return ModelConfig(n_layer=1, n_head=n_head, n_embd=n_embd, n_kv_head=n_kv_head,
                       block_size=length, vocab_size=2, causal=causal, norm="none",
                       positions="none", **kw)


def random_invertible(d: int, seed: int) -> torch.Tensor:
    """A generic Gaussian d x d matrix, scaled to O(1) singular values (invertible a.s.)."""
    return torch.randn(d, d, generator=generator(seed), dtype=F64) / d ** 0.5 \
        + torch.eye(d, dtype=F64) * 0.5


def _moved(parts: Projections, T: torch.Tensor, names: Iterable[str]) -> Projections:
    """The weights `names` of `parts` in the basis T: paper W' = T^-1 W, i.e. nn.Linear's
    weight' = W'^T = weight T^-T."""
    return Projections(**{f"w_{n}": torch.linalg.solve(T, parts.weight(n).detach().T).T
                          for n in names})


def invariance_error(n_embd: int = 16, n_head: int = 4, *, n_kv_head: int | None = None,
                     causal: bool = True, length: int = 12, seed: int = 0,
                     T: torch.Tensor | None = None) -> float:
    """max |MHA(X; W) - MHA(X T; T^-1 W)| for a random invertible T (or the given one)."""
    cfg = _cfg(n_embd, n_head, n_kv_head, causal, length)
    att = _attention(cfg, seed)
    T = random_invertible(n_embd, seed + 1) if T is None else T.to(F64)
    if T.shape != (n_embd, n_embd):
        raise QkvlabError(f"T must be {n_embd} x {n_embd}, got {tuple(T.shape)}")
    moved = copy.deepcopy(att)
    moved.load_projections(_moved(att.projections(), T, "qkv"))
    x = torch.randn(2, length, n_embd, generator=generator(seed + 2), dtype=F64)
    with torch.no_grad():
        return float((att(x) - moved(x @ T)).abs().max())


def identity_error(which: str, n_embd: int = 16, n_head: int = 4, *,
                   n_kv_head: int | None = None, causal: bool = True, length: int = 12,
                   seed: int = 0) -> float:
    """max |MHA(X; W) - MHA_{X=I}(X W_X; W_X^-1 W_P)| for which in 'q', 'k', 'v'."""
    if which not in ("q", "k", "v"):
        raise QkvlabError(f"which must be q, k or v, got {which!r}")
    src_cfg = _cfg(n_embd, n_head, n_kv_head, causal, length)
    att = _attention(src_cfg, seed)
    new_cfg = _cfg(n_embd, n_head, n_kv_head, causal, length,
                   projection=f"{which}-identity", attn_scale=src_cfg.scale)
    new = Attention(new_cfg).to(F64).eval()
    parts = att.projections()
    T = parts.weight(which).detach().T  # paper (d, d)
    new.load_projections(_moved(parts, T, [n for n in "qkv" if n != which]))
    with torch.no_grad():
        new.out_proj.weight.copy_(att.out_proj.weight)
    x = torch.randn(2, length, n_embd, generator=generator(seed + 2), dtype=F64)
    with torch.no_grad():
        return float((att(x) - new(x @ T)).abs().max())
