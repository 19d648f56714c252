"""The two modules `identity_query` puts into a transformers model in place of W_Q.

`ScaledQuery` replaces Llama's `q_proj`; `IdentityQueryCAttn` replaces GPT-2's fused `c_attn`
and keeps only its key and value columns. Both compute the query as q = r x (times head h's
learned gain on head h's d_k coordinates, if any): W_Q = I with the logit-scale ratio r folded
in, since transformers fixes the scale at 1/sqrt(d_k). No query weight, no query matmul.

Their state dicts hold what a plain transformers model expects (q_proj = r I, c_attn with the
block r I in its query columns), so `save_pretrained` writes a folder that loads in unpatched
transformers with the same logits, and a Trainer checkpoint loads back into the patched model.
The learned gain is not written separately: it is folded into that block and read back from it.
Pure torch: nothing here imports transformers.
"""

from __future__ import annotations

import torch
from torch import nn

# Relative tolerance of "this block is r I": float32 rounding of r times a gain.
IDENTITY_RTOL = 1e-6


def head_factors(w: torch.Tensor, b: torch.Tensor | None, d_head: int) -> torch.Tensor | None:
    """Head h's factor f_h when the square block `w` is diag(f_h on head h's rows) and `b` is
    zero (transpose-blind: a diagonal is its own transpose), else None."""
    if w.dim() != 2 or w.shape[0] != w.shape[1] or w.shape[0] % d_head:
        return None
    w = w.detach().double()
    diag = torch.diagonal(w)
    factors = diag.view(-1, d_head)[:, 0]
    atol = float(factors.abs().max()) * IDENTITY_RTOL
    exact = (factors.ne(0).all() and torch.allclose(w, torch.diag(diag), rtol=0, atol=atol)
             and torch.allclose(diag, factors.repeat_interleave(d_head), rtol=0, atol=atol))
    if not exact or (b is not None and bool(b.detach().ne(0).any())):
        return None
    return factors


def _autocast_like(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype autocast gives the other projections, so q matches k and v for SDPA."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class ScaledQuery(nn.Module):
    """q = r x, times head h's gain on head h's coordinates: W_Q = I at the ratio r."""

    def __init__(self, d: int, d_head: int, ratio: float, gains: torch.Tensor | None,
                 bias: bool, like: torch.Tensor):
        super().__init__()
        self.d, self.d_head, self.ratio, self.bias_in_state = d, d_head, float(ratio), bias
        # empty and not saved: follows .to() so the saved block gets the model's dtype, device
        self.register_buffer("like", torch.empty(0, dtype=like.dtype, device=like.device),
                             persistent=False)
        # named *_norm so transformers' Trainer leaves it out of weight decay as it does norm
        # gains (qkvlab's own optimizer never decays a 1-D gain)
        self.gain_norm = None if gains is None else nn.Parameter(
            gains.detach().to(device=like.device, dtype=like.dtype).clone())

    def rows(self) -> torch.Tensor:
        """The factor on each query coordinate (d,)."""
        if self.gain_norm is None:
            return torch.full((self.d,), self.ratio)
        return self.ratio * self.gain_norm.detach().double().cpu().repeat_interleave(self.d_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _autocast_like(x)
        if self.gain_norm is None:
            return x * self.ratio
        return x * (self.ratio * self.gain_norm.to(x.dtype)).repeat_interleave(self.d_head)

    def extra_repr(self) -> str:
        gain = ", learned per-head gain" if self.gain_norm is not None else ""
        return f"q = {self.ratio:.6g} * x (W_Q = I){gain}"

    def block(self, like: torch.Tensor) -> torch.Tensor:
        """The (d, d) matrix r diag(gains) this module computes, in `like`'s dtype."""
        return torch.diag(self.rows()).to(dtype=like.dtype, device=like.device)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.block(self.like)
        if self.bias_in_state:
            destination[prefix + "bias"] = torch.zeros(self.d, dtype=self.like.dtype,
                                                       device=self.like.device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if prefix + "weight" not in state_dict:
            missing_keys.append(prefix + "weight")
            return
        bias = state_dict.get(prefix + "bias") if self.bias_in_state else None
        load_factors(self, head_factors(state_dict[prefix + "weight"], bias, self.d_head),
                     prefix + "weight", error_msgs)


def load_factors(module: ScaledQuery | IdentityQueryCAttn, factors: torch.Tensor | None,
                 name: str, error_msgs: list[str]) -> None:
    """Take the per-head factors a state dict's query block holds into `module` (its gains),
    or say why they do not fit it."""
    if factors is None:
        error_msgs.append(f"{name}: the query block is not r I (per head): it holds a W_Q, "
                          "which this W_Q = I model cannot take")
        return
    gains = factors / module.ratio
    if module.gain_norm is not None:
        with torch.no_grad():
            module.gain_norm.copy_(gains.to(module.gain_norm.dtype))
    elif not torch.allclose(gains, torch.ones_like(gains), rtol=0, atol=IDENTITY_RTOL):
        error_msgs.append(f"{name}: the query block is {factors.tolist()} I per head, this "
                          f"model's is {module.ratio:.6g} I")


class IdentityQueryCAttn(ScaledQuery):
    """GPT-2's c_attn with only its key and value columns; the query is r x (a ScaledQuery)."""

    def __init__(self, c_attn: nn.Module, d_head: int, ratio: float, gains: torch.Tensor | None):
        w, b = c_attn.weight, c_attn.bias  # Conv1D: (in, out) = (d, 3d), columns [q | k | v]
        d = w.shape[0]
        super().__init__(d, d_head, ratio, gains, bias=True, like=w)
        self.weight = nn.Parameter(w.detach()[:, d:].clone())
        self.bias = nn.Parameter(b.detach()[d:].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = torch.addmm(self.bias, x.reshape(-1, self.d), self.weight)
        kv = kv.view(*x.shape[:-1], 2 * self.d)
        return torch.cat([super().forward(x).to(kv.dtype), kv], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}; k, v = x W_kv + b_kv ({self.d} -> {2 * self.d})"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        w = self.weight if keep_vars else self.weight.detach()
        b = self.bias if keep_vars else self.bias.detach()
        destination[prefix + "weight"] = torch.cat([self.block(w), w.detach()], dim=1)
        destination[prefix + "bias"] = torch.cat([b.detach().new_zeros(self.d), b.detach()])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        missing = [prefix + n for n in ("weight", "bias") if prefix + n not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        w, b = state_dict[prefix + "weight"], state_dict[prefix + "bias"]
        if tuple(w.shape) != (self.d, 3 * self.d) or tuple(b.shape) != (3 * self.d,):
            error_msgs.append(f"{prefix}weight: shape {tuple(w.shape)}, expected "
                              f"({self.d}, {3 * self.d}) with the query columns r I")
            return
        load_factors(self, head_factors(w[:, :self.d], b[:self.d], self.d_head),
                     prefix + "weight", error_msgs)
        with torch.no_grad():
            self.weight.copy_(w[:, self.d:])
            self.bias.copy_(b[self.d:])
