"""qkvlab GPT <-> the Llama architecture of Hugging Face `transformers` (LlamaForCausalLM).

Pure tensor and dict work: nothing here imports `transformers`.

A Llama-style qkvlab model (norm = rmsnorm, positions = rope, mlp = swiglu, full residuals,
causal) maps onto LlamaForCausalLM one tensor at a time: `nn.Linear` weights are stored (out, in)
on both sides, the SwiGLU's fused [gate | up] matrix splits into gate_proj and up_proj, and both
sides rotate the channel pairs (i, i + d_k/2) with the same frequencies, so RoPE needs no
permutation. Grouped-query attention is Llama's num_key_value_heads, with the same assignment of
query heads to key/value heads (query head h reads key/value head h // (n_head / n_kv_head)).

Why W_Q = I exports to plain Llama: Llama scales q.k by 1/sqrt(d_k) and rotates q after its
projection. A per-head factor commutes with the rotation, so an identity query with qkvlab's
scale s becomes q_proj = r I with r = s sqrt(d_k), and a learned per-head gain g_h becomes
r g_h on head h's rows. The same holds for an identity key (k_proj = r I) or value (v_proj = I).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from qkvlab import __version__
from qkvlab.errors import QkvlabError
from qkvlab.hf.sizes import check_sizes
from qkvlab.model.attention_layout import AttentionLayout, Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.model.parametrization import folded_for_export

LLAMA_ARCH = "LlamaForCausalLM"
QKVLAB_KEY = "qkvlab"  # config.json entry recording where an export came from
# torch's nn.RMSNorm without an eps uses the input dtype's epsilon; exports are float32 models
TORCH_RMS_EPS = float(torch.finfo(torch.float32).eps)
SCALE_RTOL = 1e-6  # identity blocks are detected to float32 rounding of r = s sqrt(d_k)
# config.json keys whose non-default value changes the function in a way qkvlab does not compute
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "rope_scaling": (None,), "sliding_window": (None,), "pretraining_tp": (1, None),
    "attention_dropout": (0, 0.0, None), "hidden_act": ("silu",),
    "layer_types": (None,), "use_sliding_window": (False, None),
}


def is_llama_style(cfg: ModelConfig) -> bool:
    """RMSNorm, RoPE and a SwiGLU MLP: the models `export --format hf` writes as Llama."""
    return cfg.norm == "rmsnorm" and cfg.positions == "rope" and cfg.mlp == "swiglu"


def llama_problem(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot be written as a Llama model, or None when it can (exactly)."""
    base = "Llama (transformers, no custom code) cannot express"
    if not cfg.causal:
        return f"{base} a bidirectional encoder (causal=false): its attention is causal"
    if not is_llama_style(cfg):
        return (f"{base} norm={cfg.norm}, positions={cfg.positions}, mlp={cfg.mlp}: it has "
                "RMSNorm, RoPE and a SwiGLU MLP")
    if cfg.residual != "full":
        return f"{base} residual={cfg.residual}: its blocks are x + attn(n1 x), then + mlp(n2 x)"
    if cfg.projection == "nonlinear-q":
        return f"{base} the nonlinear query Q(X) = (X + f(X))/2: its query is linear"
    return None


def _ratio_rows(r: float, gains: torch.Tensor | None, dk: int, ref: torch.Tensor
                ) -> torch.Tensor:
    """The factor on each output row of the carrier projection: r, times head h's learned
    gain on head h's d_k rows."""
    n = ref.shape[0] if gains is None else gains.numel() * dk
    rows = torch.full((n,), r, dtype=torch.float64)
    if gains is not None:
        rows = rows * gains.detach().double().cpu().repeat_interleave(dk)
    return rows.to(ref.dtype)


def llama_config(cfg: ModelConfig, *, dtype: torch.dtype, eot_token: int | None,
                 extra: dict[str, Any] | None) -> dict[str, Any]:
    """config.json of the LlamaForCausalLM that computes `cfg`'s function."""
    config: dict[str, Any] = {
        "architectures": [LLAMA_ARCH], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_head, "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps if cfg.norm_eps is not None else TORCH_RMS_EPS,
        "rope_theta": cfg.rope_base,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},  # 5.x
        "hidden_act": "silu", "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if eot_token is not None:
        config["bos_token_id"] = config["eos_token_id"] = eot_token
    config[QKVLAB_KEY] = {"version": __version__, "model": cfg.to_dict(), **(extra or {})}
    return config


def to_llama(model: GPT, *, eot_token: int | None = None,
             extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, safetensors tensors) of the LlamaForCausalLM equal to `model`."""
    cfg, sd = folded_for_export(model)  # a tied μP head untied, its multiplier in
    problem = llama_problem(cfg)
    if problem is not None:
        raise QkvlabError(f"cannot export as Llama: {problem}; no exact export exists (see "
                          "docs/hf.md)")
    ref = sd["wte.weight"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": ref,
                                    "model.norm.weight": sd["norm_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i, block in model.layers():
        p = f"blocks.{0 if cfg.share_layers else i}."
        h = f"model.layers.{i}."
        parts = block.attn.projections().map(lambda t: t.detach().to("cpu"))
        out.update(_attention_tensors(cfg, sd, p, h + "self_attn.", parts, ref))
        gate, up = sd[p + "mlp.fc_in.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = sd[p + "mlp.fc_out.weight"]
        if cfg.bias:
            gate_b, up_b = sd[p + "mlp.fc_in.bias"].chunk(2)
            out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gate_b, up_b
            out[h + "mlp.down_proj.bias"] = sd[p + "mlp.fc_out.bias"]
        out[h + "input_layernorm.weight"] = sd[p + "norm1.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "norm2.weight"]
    config = llama_config(cfg, dtype=ref.dtype, eot_token=eot_token, extra=extra)
    return config, {k: v.contiguous().clone() for k, v in out.items()}


def _attention_tensors(cfg: ModelConfig, sd: dict[str, torch.Tensor], p: str, h: str,
                       parts: Projections, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """q/k/v/o_proj of one layer from its attention `parts`, identity projections written as
    (scaled) identity matrices and the scale ratio folded into the identity block (the query
    block otherwise)."""
    d, dk, bias = cfg.n_embd, cfg.d_head, cfg.bias
    weights = {n: parts.weight(n) for n in "qkv"}
    biases = {n: parts.bias(n) for n in "qkv"} if bias else {}
    for n in "qkv":
        if weights[n] is None:  # the identity projection of this scheme
            weights[n] = torch.eye(d, dtype=ref.dtype)
            if bias:
                biases[n] = torch.zeros(d, dtype=ref.dtype)
    carrier = "k" if cfg.projection == "k-identity" else "q"
    rows = _ratio_rows(cfg.scale * math.sqrt(dk), sd.get(p + "attn.logit_gain"), dk,
                       weights[carrier])
    weights[carrier] = weights[carrier] * rows[:, None]
    if bias:
        biases[carrier] = biases[carrier] * rows
    out = {h + f"{n}_proj.weight": weights[n] for n in "qkv"}
    out[h + "o_proj.weight"] = sd[p + "attn.out_proj.weight"]
    if bias:
        out.update({h + f"{n}_proj.bias": biases[n] for n in "qkv"})
        out[h + "o_proj.bias"] = sd[p + "attn.out_proj.bias"]
    return out


# ---- import -----------------------------------------------------------------------------------
# config.json's layer count and widths, bounded by the tensors present before anything is
# built from them (hf/sizes.py); max_position_embeddings has no table (RoPE) and ModelConfig
# bounds it
LLAMA_LAYER_FIELDS = ("num_hidden_layers",)
LLAMA_WIDTH_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "vocab_size")


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise QkvlabError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _float(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise QkvlabError(f"config.json: {key} must be a finite number, got {value!r}")
    return float(value)


def _bool(config: dict[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise QkvlabError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def _rope_base(config: dict[str, Any]) -> float:
    """rope_theta from transformers 5's rope_parameters or 4's rope_theta; anything but the
    default (unscaled) RoPE is refused."""
    params = config.get("rope_parameters")
    if params is None:
        return _float(config, "rope_theta", 10000.0)
    if not isinstance(params, dict):
        raise QkvlabError(f"config.json: rope_parameters must be an object, got {params!r}")
    if params.get("rope_type", "default") != "default" or set(params) - {"rope_type",
                                                                          "rope_theta"}:
        raise QkvlabError(f"config.json: rope_parameters {params} scale or change RoPE; qkvlab "
                          "implements the default RoPE only (no rope scaling)")
    return _float(params, "rope_theta", 10000.0)


def check_llama_config(config: dict[str, Any]) -> ModelConfig:
    """The qkvlab ModelConfig (before detecting identity projections) of a Llama config.json,
    or a one-line error naming the field qkvlab cannot reproduce."""
    if config.get("model_type") != "llama":
        raise QkvlabError(f"config.json: model_type {config.get('model_type')!r} is not llama")
    for key, allowed in UNSUPPORTED.items():
        if config.get(key) not in allowed:
            raise QkvlabError(f"config.json: {key} = {config.get(key)!r} is not supported "
                              f"(qkvlab computes {allowed[0]!r} only): this model would load "
                              "as a different function")
    attn_bias, mlp_bias = _bool(config, "attention_bias", False), _bool(config, "mlp_bias", False)
    if attn_bias != mlp_bias:
        raise QkvlabError(f"config.json: attention_bias={attn_bias} with mlp_bias={mlp_bias}: "
                          "qkvlab has biases everywhere or nowhere (model.bias)")
    d, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    head_dim = config.get("head_dim")
    head_dim = d // heads if head_dim is None else _int(config, "head_dim")
    return ModelConfig(
        n_layer=_int(config, "num_hidden_layers"), n_head=heads, n_embd=d,
        block_size=_int(config, "max_position_embeddings"), vocab_size=_int(config, "vocab_size"),
        n_kv_head=_int(config, "num_key_value_heads", heads),
        head_dim=None if head_dim * heads == d else head_dim,
        mlp_hidden=_int(config, "intermediate_size"), mlp="swiglu", bias=attn_bias,
        tie_embeddings=_bool(config, "tie_word_embeddings", False), norm="rmsnorm",
        norm_eps=_float(config, "rms_norm_eps", 1e-6), positions="rope",
        rope_base=_rope_base(config), init_std=_float(config, "initializer_range", 0.02),
    )


def _identity_ratio(w: torch.Tensor) -> float | None:
    """r when w == r I (float32 rounding allowed), else None."""
    if w.shape[0] != w.shape[1]:
        return None
    r = float(w[0, 0])
    if r == 0 or not torch.allclose(w.double(), r * torch.eye(w.shape[0], dtype=torch.float64),
                                    rtol=0, atol=abs(r) * SCALE_RTOL):
        return None
    return r


def from_llama(config: dict[str, Any], tensors: dict[str, torch.Tensor], *,
               detect: bool = True) -> GPT:
    """A qkvlab GPT equal to the LlamaForCausalLM of (config.json, its tensors). With `detect`,
    a q_proj (or k_proj) equal to r I in every layer imports as W_Q = I (W_K = I) with scale
    r / sqrt(d_k); without it every projection is kept as a matrix (projection=baseline)."""
    check_sizes(config, tensors, layers=LLAMA_LAYER_FIELDS, widths=LLAMA_WIDTH_FIELDS)
    cfg = check_llama_config(config)
    sd = {k.removeprefix("model."): v for k, v in tensors.items()}
    layer = [f"layers.{i}.self_attn." for i in range(cfg.n_layer)]
    std_scale = 1.0 / math.sqrt(cfg.d_head)
    projection, ratio = "baseline", 1.0
    for n in ("q", "k") if detect else ():
        ratios = [_identity_ratio(_need(sd, p + f"{n}_proj.weight")) for p in layer]
        if cfg.bias or None in ratios or len(set(ratios)) != 1:
            continue
        if n == "k" and cfg.kv_heads != cfg.n_head:
            continue
        projection, ratio = f"{n}-identity", ratios[0]
        break
    cfg = dataclasses.replace(cfg, projection=projection, attn_scale=std_scale * ratio)
    state = _qkvlab_state(cfg, sd, projection, ratio)
    _check_state(cfg, state)  # before GPT(cfg) allocates what config.json's sizes say
    model = GPT(cfg)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def _check_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Refuse (one line) tensors whose shapes do not follow config.json, or that are not
    finite, before the model is built (and load_state_dict would raise a traceback)."""
    with torch.device("meta"):  # shapes only: nothing is allocated
        expected = GPT(cfg).state_dict()
    V = cfg.vocab_size
    for key, want in expected.items():
        got = state.get(key)
        if got is None or tuple(got.shape) == tuple(want.shape):
            continue
        if key in ("wte.weight", "lm_head.weight") and got.dim() == 2:
            hf_key = "model.embed_tokens.weight" if key == "wte.weight" else key
            raise QkvlabError(f"mismatched vocabularies: config.json says vocab_size={V} but "
                              f"{hf_key} has {got.shape[0]} rows")
        raise QkvlabError(f"the weights do not match config.json: qkvlab's {key} would be "
                          f"{list(want.shape)} but the tensors give {list(got.shape)}")
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise QkvlabError(f"non-finite weights in {bad[0]}: nothing to import")


def _need(sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise QkvlabError(f"the weights have no {key}: not a complete LlamaForCausalLM")
    return sd[key]


def _qkvlab_state(cfg: ModelConfig, sd: dict[str, torch.Tensor], projection: str, ratio: float
                  ) -> dict[str, torch.Tensor]:
    """qkvlab's state dict from Llama's tensors (prefix "model." removed)."""
    f32 = {k: v.float() for k, v in sd.items()}
    if cfg.tie_embeddings and "lm_head.weight" in f32:
        if not torch.equal(f32.pop("lm_head.weight"), _need(f32, "embed_tokens.weight")):
            raise QkvlabError("config.json ties the head to the embedding "
                              "(tie_word_embeddings: true) but the weights hold a different "
                              "lm_head.weight: set tie_word_embeddings to false to keep it")
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    out = {"wte.weight": _need(f32, "embed_tokens.weight"),
           "norm_f.weight": _need(f32, "norm.weight")}
    out["lm_head.weight"] = out["wte.weight"] if cfg.tie_embeddings else _need(f32,
                                                                                "lm_head.weight")
    layout = AttentionLayout.of(dataclasses.replace(cfg, projection=projection))
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layer):
        a, m, p = f"layers.{i}.self_attn.", f"layers.{i}.mlp.", f"blocks.{i}."
        out.update(layout.state(Projections(**{
            f"{kind[0]}_{n}": _need(f32, a + f"{n}_proj.{kind}")
            for n in layout.kept for kind in kinds}), p + "attn."))
        for kind in kinds:
            out[p + f"attn.out_proj.{kind}"] = _need(f32, a + f"o_proj.{kind}")
            out[p + f"mlp.fc_in.{kind}"] = torch.cat([_need(f32, m + f"gate_proj.{kind}"),
                                                      _need(f32, m + f"up_proj.{kind}")])
            out[p + f"mlp.fc_out.{kind}"] = _need(f32, m + f"down_proj.{kind}")
        out[p + "norm1.weight"] = _need(f32, f"layers.{i}.input_layernorm.weight")
        out[p + "norm2.weight"] = _need(f32, f"layers.{i}.post_attention_layernorm.weight")
    known = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    extra = [k for k in sd if k not in known and not k.startswith("layers.")]
    if extra or len(sd) > len(_expected_keys(cfg)):
        names = extra or sorted(set(sd) - _expected_keys(cfg))
        raise QkvlabError(f"the weights hold tensors qkvlab would ignore ({', '.join(names[:3])})"
                          ": this model would load as a different function")
    return out


def _expected_keys(cfg: ModelConfig) -> set[str]:
    keys = {"embed_tokens.weight", "norm.weight"} | ({"lm_head.weight"}
                                                     if not cfg.tie_embeddings else set())
    suffixes = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for i in range(cfg.n_layer):
        for s in suffixes:
            keys.add(f"layers.{i}.{s}.weight")
            if cfg.bias:
                keys.add(f"layers.{i}.{s}.bias")
        keys |= {f"layers.{i}.input_layernorm.weight",
                 f"layers.{i}.post_attention_layernorm.weight"}
    return keys
