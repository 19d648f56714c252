"""qkvlab GPT <-> the GPT-2 architecture of Hugging Face `transformers` (GPT2LMHeadModel).

Pure tensor and dict work: nothing here imports `transformers`.

GPT-2's layout, as `transformers` stores it:
  * `Conv1D` weights are (in, out), the transpose of `nn.Linear`'s (out, in);
  * `attn.c_attn` packs the query, key and value columns side by side: [q | k | v], each d wide;
  * every Conv1D and LayerNorm has a bias (a qkvlab model with bias=false exports zeros);
  * logits are scaled by 1/sqrt(d_k) (`scale_attn_weights`), or by 1 without it.

Why W_Q = I exports to plain GPT-2: the identity query is the linear map q = x I, and GPT-2's
query block may hold any d x d matrix. qkvlab's scale s differs from GPT-2's 1/sqrt(d_k) by the
ratio r = s sqrt(d_k) (0.5 for the paper's halved scale), and r folds into the query block:
(x r I) k^T / sqrt(d_k) = s x k^T. The same trick writes W_K = I or W_V = I, a non-default
scale, a GQA model (its key/value heads repeated per query head), shared layers (the block
written once per layer) and positions=none (a zero position table). What GPT-2 cannot compute
at all (RoPE, RMSNorm, the nonlinear query, other skip layouts, bidirectional attention) is
refused with the reason: qkvlab ships no `trust_remote_code` model code.
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

GPT2_EPS = 1e-5  # transformers' default layer_norm_epsilon, and nn.LayerNorm's (qkvlab's)
# qkvlab activation -> transformers `activation_function` that computes the same thing.
# "gelu" in transformers is the exact erf GELU (GPT-2's own "gelu_new" is the tanh one).
ACT_TO_HF = {"gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_pytorch_tanh"}
# transformers activation -> qkvlab; gelu_new / gelu_fast are the same tanh formula.
HF_TO_ACT = {"gelu": "gelu", "gelu_python": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
             "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
QKVLAB_KEY = "qkvlab"  # config.json entry recording where an export came from
# Buffers of old GPT-2 checkpoints (the causal mask): not weights, ignored on import.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# Identity blocks are detected to this relative precision of the scale (float32 rounding of
# r = s sqrt(d_k) in the export).
SCALE_RTOL = 1e-6


def export_problem(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot be written as a GPT-2 model, or None when it can (exactly)."""
    base = "GPT-2 (transformers, no custom code) cannot express"
    if not cfg.causal:
        return f"{base} a bidirectional encoder (causal=false): its attention is causal"
    if cfg.norm != "layernorm":
        return f"{base} norm={cfg.norm}: it has LayerNorm only"
    if cfg.mlp != "gelu":
        return f"{base} mlp={cfg.mlp}: its MLP has two matrices and no gate"
    if cfg.positions == "rope":
        return f"{base} positions=rope: it has learned absolute positions only"
    if cfg.residual != "full":
        return (f"{base} residual={cfg.residual}: its blocks are x + attn(ln1 x), then "
                "+ mlp(ln2 x)")
    if cfg.projection == "nonlinear-q":
        return (f"{base} the nonlinear query Q(X) = (X + f(X))/2: its query is a linear "
                "projection")
    if cfg.n_head * cfg.d_head != cfg.n_embd:
        return (f"{base} head_dim={cfg.d_head} with n_head={cfg.n_head}, n_embd={cfg.n_embd}: "
                "its head size is n_embd / n_head")
    if cfg.activation not in ACT_TO_HF:
        return f"{base} activation={cfg.activation}"
    return None


def _hf_name(key: str) -> str:
    return key if key.startswith("lm_head.") else f"transformer.{key}"


def _repeat_heads(w: torch.Tensor, n_head: int, n_kv: int, d_head: int) -> torch.Tensor:
    """Key/value columns (d, n_kv * dk) -> (d, n_head * dk): query head h reads kv head
    h // (n_head / n_kv), as torch's SDPA with enable_gqa does."""
    if n_kv == n_head:
        return w
    lead = w.shape[:-1]
    return w.reshape(*lead, n_kv, d_head).repeat_interleave(n_head // n_kv, dim=-2) \
        .reshape(*lead, n_head * d_head)


def _scale_ratio(r: float, gains: torch.Tensor | None, dk: int) -> float | torch.Tensor:
    """The factor on the carrier block's columns: r, or r * gain_h on head h's d_k columns
    (a learned per-head scale; a factor on head h's queries or keys is one on its logits)."""
    if gains is None:
        return r
    return (r * gains.float()).repeat_interleave(dk).to(gains.dtype)


def to_gpt2(model: GPT, *, eot_token: int | None = None,
            extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, safetensors dict) of a GPT2LMHeadModel computing `model`'s logits.

    Raises QkvlabError (one line, the reason) when the architecture cannot be expressed.
    Tensors keep the model's dtype and live on the CPU.
    """
    cfg, sd = folded_for_export(model)  # a tied μP head untied, its multiplier in
    problem = export_problem(cfg)
    if problem is not None:
        raise QkvlabError(f"cannot export as GPT-2: {problem}; no exact export exists (train "
                          "with a GPT-2-compatible config, see docs/hf.md)")
    d = cfg.n_embd
    ref = sd["wte.weight"]
    zeros = lambda n: torch.zeros(n, dtype=ref.dtype)  # noqa: E731 - local shorthand
    out: dict[str, torch.Tensor] = {}
    for i, block in model.layers():
        p, h = f"blocks.{0 if cfg.share_layers else i}.", f"h.{i}."
        out[h + "attn.c_attn.weight"], out[h + "attn.c_attn.bias"] = _c_attn(
            cfg, block.attn.projections().map(lambda t: t.detach().to("cpu")), sd, p)
        out[h + "attn.c_proj.weight"] = sd[p + "attn.out_proj.weight"].T
        out[h + "attn.c_proj.bias"] = sd.get(p + "attn.out_proj.bias", zeros(d))
        out[h + "mlp.c_fc.weight"] = sd[p + "mlp.fc_in.weight"].T
        out[h + "mlp.c_fc.bias"] = sd.get(p + "mlp.fc_in.bias", zeros(cfg.hidden))
        out[h + "mlp.c_proj.weight"] = sd[p + "mlp.fc_out.weight"].T
        out[h + "mlp.c_proj.bias"] = sd.get(p + "mlp.fc_out.bias", zeros(d))
        for src, dst in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[h + f"{dst}.weight"] = sd[p + f"{src}.weight"]
            out[h + f"{dst}.bias"] = sd.get(p + f"{src}.bias", zeros(d))
    out["wte.weight"] = sd["wte.weight"]
    out["wpe.weight"] = sd.get("wpe.weight", torch.zeros(cfg.block_size, d, dtype=ref.dtype))
    out["ln_f.weight"] = sd["norm_f.weight"]
    out["ln_f.bias"] = sd.get("norm_f.bias", zeros(d))
    tensors = {_hf_name(k): v.contiguous().clone() for k, v in out.items()}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = sd["lm_head.weight"].contiguous().clone()
    return _gpt2_config(cfg, ref.dtype, eot_token, extra), tensors


def _c_attn(cfg: ModelConfig, parts: Projections, sd: dict[str, torch.Tensor],
            p: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-2's fused (d, 3d) query/key/value weight and bias for the attention `parts` of
    block prefix `p`: identity blocks for the dropped projection, K/V heads repeated under
    GQA, and the scale ratio r (GPT-2 multiplies q.k by 1/sqrt(dk); r = scale * sqrt(dk))
    folded into one block."""
    d, dk, dtype = cfg.n_embd, cfg.d_head, sd["wte.weight"].dtype
    blocks_w, blocks_b = {}, {}
    for n in "qkv":
        if parts.weight(n) is None:  # the identity projection of this scheme
            blocks_w[n], blocks_b[n] = torch.eye(d, dtype=dtype), torch.zeros(d, dtype=dtype)
            continue
        bw = parts.weight(n).T  # Conv1D's (in, out)
        bb = parts.bias(n) if parts.bias(n) is not None else torch.zeros(bw.shape[1], dtype=dtype)
        if n in "kv":
            bw = _repeat_heads(bw, cfg.n_head, cfg.kv_heads, dk)
            bb = _repeat_heads(bb, cfg.n_head, cfg.kv_heads, dk)
        blocks_w[n], blocks_b[n] = bw, bb
    # the scale ratio rides on the identity block of q/k-identity (so an import can read the
    # scale back off it), on the query block otherwise
    carrier = "k" if cfg.projection == "k-identity" else "q"
    ratio = _scale_ratio(cfg.scale * math.sqrt(dk), sd.get(p + "attn.logit_gain"), dk)
    if not isinstance(ratio, float) or ratio != 1.0:
        blocks_w[carrier] = blocks_w[carrier] * ratio
        blocks_b[carrier] = blocks_b[carrier] * ratio
    return (torch.cat([blocks_w[n] for n in "qkv"], dim=1),
            torch.cat([blocks_b[n] for n in "qkv"]))


def _gpt2_config(cfg: ModelConfig, dtype: torch.dtype, eot_token: int | None,
                 extra: dict[str, Any] | None) -> dict[str, Any]:
    p_drop = float(cfg.dropout)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.hidden,
        "activation_function": ACT_TO_HF[cfg.activation],
        "resid_pdrop": p_drop,
        "embd_pdrop": p_drop,
        "attn_pdrop": p_drop,
        "layer_norm_epsilon": GPT2_EPS,
        "initializer_range": float(cfg.init_std),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "use_cache": True,
        # GPT2Config defaults these to 50256: wrong (out of range) for other vocabularies
        "bos_token_id": eot_token,
        "eos_token_id": eot_token,
        "torch_dtype": str(dtype).removeprefix("torch."),
        QKVLAB_KEY: {"version": __version__, "model": cfg.to_dict(), **(extra or {})},
    }


# ---- import -----------------------------------------------------------------------------------

def _field(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in config and config[name] is not None:
            return config[name]
    return default


# config.json's layer count and widths, bounded by the tensors present before the shape table
# is built from them (hf/sizes.py)
GPT2_LAYER_FIELDS = ("n_layer", "num_hidden_layers")
GPT2_WIDTH_FIELDS = ("n_embd", "hidden_size", "n_head", "num_attention_heads", "vocab_size",
                     "n_positions", "max_position_embeddings", "n_inner")


def _need_int(config: dict[str, Any], *names: str, default: int | None = None) -> int:
    value = _field(config, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QkvlabError(f"config.json: {names[0]} must be a positive integer, got {value!r}")
    return value


# The torch dtype names a config.json may record (transformers 4: torch_dtype, 5: dtype).
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
# config.json fields the GPT-2 import reads (or transformers does when it loads the folder), by
# the JSON type they must have. A wrong type is refused before anything is computed: Python's
# float("abc") would raise a traceback, and bool("false") is True.
GPT2_FIELD_TYPES: dict[str, str] = {
    "vocab_size": "int", "n_embd": "int", "n_head": "int", "n_layer": "int",
    "n_positions": "int", "n_inner": "int?", "layer_norm_epsilon": "positive",
    "initializer_range": "positive", "resid_pdrop": "prob", "embd_pdrop": "prob",
    "attn_pdrop": "prob", "activation_function": "str", "tie_word_embeddings": "bool",
    "scale_attn_weights": "bool", "scale_attn_by_inverse_layer_idx": "bool",
    "reorder_and_upcast_attn": "bool", "add_cross_attention": "bool", "use_cache": "bool",
}
# Fields every supported architecture shares: token ids, the recorded dtype, the class names.
COMMON_FIELD_TYPES: dict[str, str] = {
    "bos_token_id": "token?", "eos_token_id": "token?", "pad_token_id": "token?",
    "torch_dtype": "dtype?", "dtype": "dtype?", "architectures": "names?",
}
_KIND_WORDS = {
    "int": "a positive integer", "positive": "a number > 0", "prob": "a number in [0, 1)",
    "str": "a string", "bool": "true or false", "token": "a token id (an integer >= 0)",
    "dtype": f"one of {', '.join(DTYPE_NAMES)}", "names": "a list of strings",
}


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == "positive":
        return _is_number(value) and value > 0
    if kind == "prob":
        return _is_number(value) and 0 <= value < 1
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "token":  # eos_token_id may also be a list of ids
        ids = value if isinstance(value, list) else [value]
        return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    if kind == "dtype":
        return isinstance(value, str) and value.removeprefix("torch.") in DTYPE_NAMES
    if kind == "names":
        return isinstance(value, list) and all(isinstance(n, str) for n in value)
    raise ValueError(kind)


def check_field_types(config: dict[str, Any], types: dict[str, str]) -> None:
    """Refuse (one line, naming the field) a present field whose JSON value has the wrong type;
    a kind ending in "?" also accepts null (transformers' own default then applies)."""
    for key, kind in types.items():
        if key not in config:
            continue
        value, base = config[key], kind.rstrip("?")
        if value is None and kind.endswith("?"):
            continue
        if not _has_kind(value, base):
            raise QkvlabError(f"config.json: {key} must be {_KIND_WORDS[base]}, got {value!r}")


def check_gpt2_config(config: dict[str, Any]) -> None:
    """Refuse (one line) a config.json that is not a GPT-2 qkvlab can reproduce exactly."""
    model_type = config.get("model_type")
    if model_type != "gpt2":
        arch = config.get("architectures")
        arch = ", ".join(map(str, arch)) if isinstance(arch, list) and arch else \
            "unknown architecture"
        raise QkvlabError(
            f"config.json has model_type={model_type!r} ({arch}): only GPT-2 (model_type gpt2) "
            "and Llama (model_type llama) models can be imported")
    check_field_types(config, {**COMMON_FIELD_TYPES, **GPT2_FIELD_TYPES})
    if config.get("add_cross_attention"):
        raise QkvlabError("config.json: add_cross_attention=true (an encoder-decoder GPT-2): "
                          "qkvlab has no cross-attention")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise QkvlabError("config.json: scale_attn_by_inverse_layer_idx=true scales layer l's "
                          "logits by 1/(l+1); qkvlab has one scale for all layers")
    eps = float(_field(config, "layer_norm_epsilon", default=GPT2_EPS))
    if not math.isclose(eps, GPT2_EPS, rel_tol=1e-9):
        raise QkvlabError(f"config.json: layer_norm_epsilon={eps:g}, but qkvlab's LayerNorm uses "
                          f"{GPT2_EPS:g}")
    act = _field(config, "activation_function", default="gelu_new")
    if act not in HF_TO_ACT:
        raise QkvlabError(f"config.json: activation_function={act!r} is not one of "
                          f"{', '.join(sorted(HF_TO_ACT))}")
    d, H = _need_int(config, "n_embd", "hidden_size"), _need_int(config, "n_head",
                                                                 "num_attention_heads")
    if d % H:
        raise QkvlabError(f"config.json: n_embd={d} is not divisible by n_head={H}")


def _scalar_identity(w: torch.Tensor, b: torch.Tensor) -> float | None:
    """c when the (d, d) block w is exactly c I with c > 0 and the bias is zero, else None."""
    c = float(w[0, 0])
    if c <= 0 or bool(b.any()):
        return None
    return c if torch.equal(w, c * torch.eye(w.shape[0], dtype=w.dtype)) else None


def _same(values: list[float | None]) -> float | None:
    first = values[0]
    if first is None or any(v is None or v != first for v in values):
        return None
    return first


def from_gpt2(config: dict[str, Any], tensors: dict[str, torch.Tensor], *,
              detect: bool = True) -> tuple[GPT, list[str]]:
    """A float32 qkvlab GPT computing the same logits as GPT2LMHeadModel(config) with `tensors`.

    With `detect`, exact structure is read back rather than stored as weights: an identity
    query/key/value block (c I) becomes projection q-/k-/v-identity with the scale it carries,
    all-zero biases become bias=false and an all-zero position table positions=none. So an
    export of a qkvlab model imports as the same scheme. Returns (model, notes).
    """
    check_gpt2_config(config)
    check_sizes(config, tensors, layers=GPT2_LAYER_FIELDS, widths=GPT2_WIDTH_FIELDS)
    notes: list[str] = []
    d = _need_int(config, "n_embd", "hidden_size")
    H = _need_int(config, "n_head", "num_attention_heads")
    L = _need_int(config, "n_layer", "num_hidden_layers")
    V = _need_int(config, "vocab_size")
    T = _need_int(config, "n_positions", "max_position_embeddings", default=1024)
    inner = _need_int(config, "n_inner", default=4 * d)
    dk = d // H
    tied = config.get("tie_word_embeddings", True)  # a bool: check_gpt2_config saw to it
    sd = _float32_weights(tensors, notes)
    _check_weights(sd, _gpt2_shapes(d, L, V, T, inner, tied), V, tied, notes)

    # GPT-2's logit scale; identity detection below may move part of it into attn_scale.
    hf_scale = 1.0 / math.sqrt(dk) if config.get("scale_attn_weights", True) else 1.0
    qkv = [sd[f"h.{i}.attn.c_attn.weight"].split(d, dim=1) for i in range(L)]
    qkv_b = [sd[f"h.{i}.attn.c_attn.bias"].split(d) for i in range(L)]
    projection, scale = _detect_identity(qkv, qkv_b, hf_scale, notes) if detect \
        else ("baseline", hf_scale)
    biases = [k for k in sd if k.endswith(".bias")]
    bias = not detect or any(bool(sd[k].any()) for k in biases)
    positions = "learned"
    if detect and not bool(sd["wpe.weight"].any()):
        positions = "none"
        notes.append("the position table is all zeros: imported as positions=none")

    p_drops = [float(_field(config, k, default=0.1)) for k in ("resid_pdrop", "embd_pdrop",
                                                                "attn_pdrop")]
    if len(set(p_drops)) > 1:
        notes.append(f"dropout: qkvlab has one rate; resid/embd/attn_pdrop = {p_drops}, "
                     f"using resid_pdrop = {p_drops[0]}")
    cfg = ModelConfig(
        n_layer=L, n_head=H, n_embd=d, block_size=T, vocab_size=V, mlp_hidden=inner,
        bias=bias, dropout=p_drops[0], tie_embeddings=tied,
        activation=HF_TO_ACT[_field(config, "activation_function", default="gelu_new")],
        norm="layernorm", positions=positions, residual="full", projection=projection,
        init_std=float(_field(config, "initializer_range", default=0.02)),
    )
    if not math.isclose(scale, cfg.scale, rel_tol=SCALE_RTOL):  # not the default "paper" rule
        # the ratio went through float32: 7 significant digits give back e.g. 0.3, not
        # 0.30000001192 (a 1e-7 relative change of the logits, far below float32 noise)
        cfg = dataclasses.replace(cfg, attn_scale=float(f"{scale:.7g}"))
    model = GPT(cfg)
    model.load_state_dict(_qkvlab_state(sd, qkv, qkv_b, cfg), strict=True)
    model.eval()
    return model, notes


def _float32_weights(tensors: dict[str, torch.Tensor], notes: list[str]
                     ) -> dict[str, torch.Tensor]:
    """The weights by GPT2Model name (no "transformer." prefix, no mask buffers), in float32."""
    sd: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.endswith(IGNORED_SUFFIXES):
            continue
        sd[key.removeprefix("transformer.")] = value.detach().to("cpu", torch.float32)
    if any(t.dtype != torch.float32 for t in tensors.values()):
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        notes.append(f"weights stored as {', '.join(dtypes)}: upcast to float32")
    return sd


def _gpt2_shapes(d: int, L: int, V: int, T: int, inner: int, tied: bool
                 ) -> dict[str, tuple[int, ...]]:
    """Every tensor a GPT2LMHeadModel of these sizes stores, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (V, d), "wpe.weight": (T, d),
                                          "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(L):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "mlp.c_fc.weight": (d, inner), h + "mlp.c_fc.bias": (inner,),
            h + "mlp.c_proj.weight": (inner, d), h + "mlp.c_proj.bias": (d,),
        })
    if not tied:
        shapes["lm_head.weight"] = (V, d)
    return shapes


def _check_weights(sd: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], V: int,
                   tied: bool, notes: list[str]) -> None:
    """Refuse weights that are not exactly `shapes`, or not finite; drop a tied head's copy."""
    if tied and "lm_head.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd.get("wte.weight", sd["lm_head.weight"])):
            # transformers 5 then keeps the stored head and 4.x ties it to the embedding: the
            # folder means two different models, so neither is guessed
            raise QkvlabError("config.json ties the head to the embedding "
                              "(tie_word_embeddings: true) but the weights hold a different "
                              "lm_head.weight: set tie_word_embeddings to false to keep that "
                              "head, or remove lm_head.weight to use the embedding")
        del sd["lm_head.weight"]
    for key in ("wte.weight", "lm_head.weight"):
        if key in sd and key in shapes and sd[key].dim() == 2 and sd[key].shape[0] != V:
            raise QkvlabError(f"mismatched vocabularies: config.json says vocab_size={V} but "
                              f"{_hf_name(key)} has {sd[key].shape[0]} rows")
    missing = [k for k in shapes if k not in sd]
    if missing:
        raise QkvlabError(f"the weights lack {len(missing)} GPT-2 tensor(s) of config.json's "
                          f"shape (e.g. {_hf_name(missing[0])}): the files do not match "
                          "config.json, or this is not a GPT2LMHeadModel checkpoint")
    unexpected = sorted(set(sd) - set(shapes))
    if unexpected:
        raise QkvlabError(f"the weights hold tensors GPT-2 does not have (e.g. "
                          f"{_hf_name(unexpected[0])}): not a plain GPT2LMHeadModel checkpoint")
    for key, shape in shapes.items():
        if tuple(sd[key].shape) != shape:
            raise QkvlabError(f"{_hf_name(key)} is {list(sd[key].shape)}, but config.json "
                              f"implies {list(shape)}")
    bad = [k for k, v in sd.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise QkvlabError(f"non-finite weights in {_hf_name(bad[0])}: nothing to import")


def _detect_identity(qkv: list[tuple[torch.Tensor, ...]], qkv_b: list[tuple[torch.Tensor, ...]],
                     hf_scale: float, notes: list[str]) -> tuple[str, float]:
    """(projection, scale): the first of Q, K, V that is the same c I in every layer becomes
    the identity, c moving into the scale; ("baseline", hf_scale) when none is."""
    for idx, name in ((0, "q-identity"), (1, "k-identity"), (2, "v-identity")):
        c = _same([_scalar_identity(w[idx], b[idx]) for w, b in zip(qkv, qkv_b, strict=True)])
        if c is not None and (idx < 2 or c == 1.0):  # V's scale cannot move into s
            notes.append(f"every layer's {'QKV'[idx]} block is {c:g} I: imported as "
                         f"projection={name}")
            return name, hf_scale * c
    return "baseline", hf_scale


def _qkvlab_state(sd: dict[str, torch.Tensor], qkv: list[tuple[torch.Tensor, ...]],
                  qkv_b: list[tuple[torch.Tensor, ...]], cfg: ModelConfig
                  ) -> dict[str, torch.Tensor]:
    """GPT-2's tensors under qkvlab's names, Conv1D (in, out) turned into Linear (out, in); the
    identity block of q/k/v is left out of the fused projection."""
    L, bias, tied = cfg.n_layer, cfg.bias, cfg.tie_embeddings
    new: dict[str, torch.Tensor] = {"wte.weight": sd["wte.weight"],
                                    "norm_f.weight": sd["ln_f.weight"]}
    if cfg.positions == "learned":
        new["wpe.weight"] = sd["wpe.weight"]
    if bias:
        new["norm_f.bias"] = sd["ln_f.bias"]
    if not tied:
        new["lm_head.weight"] = sd["lm_head.weight"]
    layout = AttentionLayout.of(cfg)
    for i in range(L):
        h, p = f"h.{i}.", f"blocks.{i}."
        # Conv1D's (in, out) blocks [q | k | v] as nn.Linear (out, in), the identity left out
        kept = {f"w_{n}": qkv[i][j].T for j, n in enumerate("qkv") if n in layout.kept}
        if bias:
            kept |= {f"b_{n}": qkv_b[i][j] for j, n in enumerate("qkv") if n in layout.kept}
        new.update(layout.state(Projections(**kept), p + "attn."))
        new[p + "attn.out_proj.weight"] = sd[h + "attn.c_proj.weight"].T
        new[p + "mlp.fc_in.weight"] = sd[h + "mlp.c_fc.weight"].T
        new[p + "mlp.fc_out.weight"] = sd[h + "mlp.c_proj.weight"].T
        new[p + "norm1.weight"] = sd[h + "ln_1.weight"]
        new[p + "norm2.weight"] = sd[h + "ln_2.weight"]
        if bias:
            new[p + "attn.out_proj.bias"] = sd[h + "attn.c_proj.bias"]
            new[p + "mlp.fc_in.bias"] = sd[h + "mlp.c_fc.bias"]
            new[p + "mlp.fc_out.bias"] = sd[h + "mlp.c_proj.bias"]
            new[p + "norm1.bias"] = sd[h + "ln_1.bias"]
            new[p + "norm2.bias"] = sd[h + "ln_2.bias"]
    if tied:
        new["lm_head.weight"] = new["wte.weight"]
    return {k: v.contiguous() for k, v in new.items()}
