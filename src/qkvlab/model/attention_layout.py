"""Where W_Q, W_K and W_V sit in an attention's fused `in_proj`, by name.

`Attention.in_proj` stacks the rows (nn.Linear's (out, in) convention) of the projections the
scheme has, in the order [q | k | v]; the one a scheme replaces by the identity (and the
nonlinear query's W_Q) has no rows. Code outside the model reads and writes the projections
through this module (`AttentionLayout`, `Attention.projections`, `Attention.load_projections`)
and never cuts in_proj itself, so the fused layout can change in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from qkvlab.errors import require
from qkvlab.model.config import ModelConfig

PARTS: tuple[str, ...] = ("q", "k", "v")


@dataclass(frozen=True)
class Projections:
    """W_Q, W_K, W_V of one attention, nn.Linear's (out, in), and their biases (out,).

    None where the attention has no such matrix (an identity projection, the nonlinear
    query's W_Q) or no bias; as an argument to a writer, None also means "leave it as it is".
    """

    w_q: torch.Tensor | None = None
    w_k: torch.Tensor | None = None
    w_v: torch.Tensor | None = None
    b_q: torch.Tensor | None = None
    b_k: torch.Tensor | None = None
    b_v: torch.Tensor | None = None

    def weight(self, name: str) -> torch.Tensor | None:
        """W_name for name in 'q', 'k', 'v'."""
        return getattr(self, f"w_{name}")

    def bias(self, name: str) -> torch.Tensor | None:
        """b_name for name in 'q', 'k', 'v'."""
        return getattr(self, f"b_{name}")

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Projections:
        """The same parts with `fn` applied to each present tensor (a dtype or device move)."""
        return Projections(**{f.name: None if getattr(self, f.name) is None
                              else fn(getattr(self, f.name)) for f in fields(self)})


@dataclass(frozen=True)
class AttentionLayout:
    """The rows of W_Q, W_K and W_V in the fused in_proj (0 for one the scheme lacks)."""

    n_embd: int
    sizes: tuple[int, int, int]
    bias: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> AttentionLayout:
        q_dim, kv_dim = cfg.n_head * cfg.d_head, cfg.kv_heads * cfg.d_head
        sizes = (0 if cfg.projection in ("q-identity", "nonlinear-q") else q_dim,
                 0 if cfg.projection == "k-identity" else kv_dim,
                 0 if cfg.projection == "v-identity" else kv_dim)
        return cls(cfg.n_embd, sizes, cfg.bias)

    @property
    def kept(self) -> tuple[str, ...]:
        """The projections in_proj holds, in its row order."""
        return tuple(n for n, size in zip(PARTS, self.sizes, strict=True) if size)

    def shape(self, name: str) -> tuple[int, int] | None:
        """W_name's (out, in), or None when in_proj holds no W_name."""
        size = self.sizes[PARTS.index(name)]
        return (size, self.n_embd) if size else None

    def split(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Projections:
        """Named views (no copies) of a fused in_proj weight (and bias)."""
        require(tuple(weight.shape) == (sum(self.sizes), self.n_embd),
                f"a fused in_proj of this layout is {(sum(self.sizes), self.n_embd)}, "
                f"got {tuple(weight.shape)}")
        parts, start = {}, 0
        for name, size in zip(PARTS, self.sizes, strict=True):
            if size:  # narrow, not split: plain views, which stay readable after in_proj
                # is written in place (split's outputs would refuse)
                parts[f"w_{name}"] = weight.narrow(0, start, size)
                parts[f"b_{name}"] = None if bias is None else bias.narrow(0, start, size)
            start += size
        return Projections(**parts)

    def fuse(self, parts: Projections) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused in_proj weight, and bias (None without biases), holding `parts`: every
        projection of the layout, none of the others."""
        for name in PARTS:
            held, shape = name in self.kept, self.shape(name)
            w, b = parts.weight(name), parts.bias(name)
            require((w is not None) == held and (b is not None) == (held and self.bias),
                    f"this attention {'holds' if held else 'has no'} W_{name.upper()}"
                    f"{' and b_' + name.upper() if held and self.bias else ''}: "
                    f"got w_{name}={'a tensor' if w is not None else None}, "
                    f"b_{name}={'a tensor' if b is not None else None}")
            got = None if w is None else tuple(w.shape)
            require(got in (None, shape), f"W_{name.upper()} must be {shape} (out, in), got {got}")
        weight = torch.cat([parts.weight(n) for n in self.kept])
        bias = torch.cat([parts.bias(n) for n in self.kept]) if self.bias else None
        return weight, bias

    def state(self, parts: Projections, prefix: str = "") -> dict[str, torch.Tensor]:
        """`parts` as the state-dict entries of the attention at `prefix` ("blocks.0.attn.")."""
        weight, bias = self.fuse(parts)
        out = {prefix + "in_proj.weight": weight}
        if bias is not None:
            out[prefix + "in_proj.bias"] = bias
        return out
