"""W_Q = I inside a transformers model: `identity_query(model, scale=...)`.

    model = LlamaForCausalLM(config)          # or GPT2LMHeadModel, or .from_pretrained(dir)
    identity_query(model, scale="standard")   # W_Q = I from scratch, at the standard 1/sqrt(d_k)
    Trainer(model=model, ...).train()         # nothing else changes
    model.save_pretrained(out)                # a plain folder: q_proj = r I written out

Three ways in, one per kind of query weight:
  scale=...            start W_Q = I from scratch: the query weights are dropped, whatever they
                       hold, and the scale is qkvlab's `model.attn_scale` rule or number
                       (`qkvlab.model.scale.attention_scale`, the function qkvlab's own model
                       uses); a learned rule ("learned") adds one gain per head.
  (no scale)           keep the function: every layer's query block must be r I (per head, as
                       qkvlab's export and `save_pretrained` of a patched model write it); r
                       is read back and kept. Anything else is refused.
  approximate=INIT     keep the function as well as W_Q = I can: qkvlab's retrofit
                       (`qkvlab.retrofit.build_student`, INIT one of its inits; "regress"
                       needs calibration token batches) moves W_Q into the keys first.
transformers fixes the logit scale at `attn.scaling` (1/sqrt(d_k)), so qkvlab's scale s is
folded into the identity as the ratio r = s / attn.scaling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from qkvlab.errors import QkvlabError, require
from qkvlab.hf.identity_modules import IdentityQueryCAttn, ScaledQuery, head_factors
from qkvlab.model.config import checked_scale_setting
from qkvlab.model.scale import attention_scale, learns_scale

# model_type -> what identity_query knows of it (GPT-2's cross-attention has its own q_attn)
KNOWN = {"llama": "LlamaForCausalLM / LlamaModel", "gpt2": "GPT2LMHeadModel / GPT2Model"}


@dataclass(frozen=True)
class IdentityQueryReport:
    """What `identity_query` did."""

    architecture: str
    layers: int
    how: str  # "from scratch", "kept (q_proj = r I)" or "approximated (retrofit INIT)"
    scale: float  # the logit scale of layer 0 (r * attn.scaling), before any learned gain
    ratios: tuple[float, ...]  # r per layer
    learned_gain: bool
    parameters_removed: int  # net of any per-head gains added

    def summary(self) -> str:
        gain = ", learned per-head gain" if self.learned_gain else ""
        return (f"{self.architecture}: W_Q = I in {self.layers} layers ({self.how}), scale "
                f"{self.scale:.6g}{gain}; {self.parameters_removed:,} parameters removed")


@dataclass(frozen=True)
class _Site:
    """One self-attention module and the query block it holds."""

    attn: nn.Module
    kind: str  # "llama" or "gpt2"

    @property
    def d_head(self) -> int:
        return int(self.attn.head_dim)

    def query_block(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "llama":
            return self.attn.q_proj.weight, self.attn.q_proj.bias
        d = self.attn.c_attn.weight.shape[0]
        return self.attn.c_attn.weight[:, :d], self.attn.c_attn.bias[:d]


def identity_query(model: nn.Module, scale: float | str | None = None, *,
                   approximate: str | None = None,
                   calibration: Iterable[torch.Tensor] | None = None) -> IdentityQueryReport:
    """Make `model` (a transformers Llama or GPT-2) W_Q = I in place; see the module doc."""
    require(scale is None or approximate is None,
            "identity_query takes scale= (start from scratch) or approximate= (keep the "
            "function via retrofit), not both")
    kind, sites = _sites(model)
    before = _count(model)
    if approximate is not None:
        _approximate(model, kind, approximate, calibration)
        how = f"approximated (retrofit {approximate})"
        ratios, gains = _kept(sites, model)
    elif scale is None:
        how = "kept (q_proj = r I)"
        ratios, gains = _kept(sites, model)
    else:
        how = "from scratch"
        ratios, gains = _fresh(sites, model, scale)
    for site, ratio, gain in zip(sites, ratios, gains, strict=True):
        _replace(site, ratio, gain)
    return IdentityQueryReport(
        architecture=type(model).__name__, layers=len(sites), how=how,
        scale=ratios[0] * float(sites[0].attn.scaling), ratios=tuple(ratios),
        learned_gain=gains[0] is not None, parameters_removed=before - _count(model))


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _sites(model: nn.Module) -> tuple[str, list[_Site]]:
    """The model's kind and its self-attention modules, or a one-line refusal."""
    # transformers is optional (the hf extra): imported only when a model is patched
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in KNOWN:
        raise QkvlabError(f"identity_query knows {', '.join(KNOWN.values())}; "
                          f"{type(model).__name__} (model_type {kind!r}) is not one, so its "
                          "query projection would stay: convert it to one of them first")
    cls = LlamaAttention if kind == "llama" else GPT2Attention
    found = [m for m in model.modules() if type(m) is cls]
    patched = any(isinstance(m, ScaledQuery) for m in model.modules())
    require(not patched, f"{type(model).__name__} already has W_Q = I (identity_query ran on it)")
    require(found and len(found) == config.num_hidden_layers
            and not getattr(config, "add_cross_attention", False),
            f"{type(model).__name__}: expected {config.num_hidden_layers} {cls.__name__} "
            f"self-attention modules and no cross-attention, found {len(found)}: identity_query "
            "knows the stock architecture only")
    d = config.hidden_size
    heads = config.num_attention_heads
    require(int(found[0].head_dim) * heads == d,
            f"W_Q = I needs num_attention_heads * head_dim == hidden_size (the query is the "
            f"hidden state itself); this model has {heads} x {found[0].head_dim} != {d}")
    return kind, [_Site(m, kind) for m in found]


def _fresh(sites: list[_Site], model: nn.Module, setting: float | str
           ) -> tuple[list[float], list[torch.Tensor | None]]:
    """Ratios (and unit gains for a learned rule) for W_Q = I from scratch at `setting`."""
    config = model.config
    d_head = sites[0].d_head
    init_std = float(getattr(config, "initializer_range", 0.02))
    # the bounds and spellings a qkvlab config's model.attn_scale is held to
    setting = checked_scale_setting(setting, "q-identity", config.hidden_size, d_head, init_std,
                                    name="scale")
    s = attention_scale(setting, "q-identity", config.hidden_size, d_head, init_std)
    gain = torch.ones(config.num_attention_heads) if learns_scale(setting) else None
    return [s / float(site.attn.scaling) for site in sites], [gain] * len(sites)


def _kept(sites: list[_Site], model: nn.Module
          ) -> tuple[list[float], list[torch.Tensor | None]]:
    """Each layer's ratio read back from its query block r I (per-head factors become a
    gain on their mean), or a one-line refusal naming the first layer that is not."""
    ratios, gains = [], []
    for i, site in enumerate(sites):
        w, b = site.query_block()
        factors = head_factors(w, b, site.d_head)
        if factors is None:
            raise QkvlabError(
                f"{type(model).__name__} layer {i}: the query projection is not a multiple of "
                "I (it holds a trained or random W_Q): pass scale=... to start W_Q = I from "
                "scratch, or approximate='regress' (with calibration batches) to keep the "
                "function as well as qkvlab's retrofit can")
        same = torch.allclose(factors, factors[:1].expand_as(factors), rtol=1e-6, atol=0)
        ratio = float(factors[0]) if same else float(factors.mean())
        ratios.append(ratio)
        gains.append(None if same else factors / ratio)
    if any(g is not None for g in gains):  # one module type for all layers: all get gains
        gains = [g if g is not None else torch.ones(model.config.num_attention_heads)
                 for g in gains]
    return ratios, gains


def _replace(site: _Site, ratio: float, gain: torch.Tensor | None) -> None:
    attn = site.attn
    if site.kind == "llama":
        q = attn.q_proj
        attn.q_proj = ScaledQuery(q.in_features, site.d_head, ratio, gain, q.bias is not None,
                                  like=q.weight)
    else:
        attn.c_attn = IdentityQueryCAttn(attn.c_attn, site.d_head, ratio, gain)


def _approximate(model: nn.Module, kind: str, init: str,
                 calibration: Iterable[torch.Tensor] | None) -> None:
    """qkvlab's retrofit on this model's weights, written back: afterwards every query block is
    r I (W_Q moved into the keys as well as the init can)."""
    # in-function: only this path needs the converters and the retrofit (and its theory)
    from qkvlab.hf.gpt2 import from_gpt2, to_gpt2
    from qkvlab.hf.llama import from_llama, to_llama
    from qkvlab.retrofit import INITS, attention_moments, build_student

    require(init in INITS, f"approximate={init!r}: use one of {', '.join(INITS)}")
    require(init != "regress" or calibration is not None,
            "approximate='regress' fits each head's query on real activations: pass "
            "calibration=[token id batches (B, T)] from your training data")
    config = model.config.to_dict()
    ref = next(model.parameters())
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if kind == "llama":
        gpt = from_llama(config, tensors, detect=False)
    else:
        gpt, _ = from_gpt2(config, tensors, detect=False)
    moments = None
    if init == "regress":
        moments = attention_moments(gpt, (torch.as_tensor(t).cpu() for t in calibration))
    student, _ = build_student(gpt, init, moments)
    _, out = to_llama(student) if kind == "llama" else to_gpt2(student)
    own = model.state_dict()
    with torch.no_grad():
        for name, value in out.items():
            if name in own and own[name].shape == value.shape:
                own[name].copy_(value.to(ref.dtype))
