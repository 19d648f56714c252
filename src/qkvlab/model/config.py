"""Model configuration: one typed, validated dataclass for the whole model family.

The projection scheme (`projection`) is THE switch for which of W_Q, W_K, W_V is the identity,
or whether the query is the nonlinear map of the follow-up paper. Everything else in the model
reads it from here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from qkvlab.errors import QkvlabError, require
from qkvlab.model.cpu_kind import cpu_kind
from qkvlab.model.scale import (
    SCALE_BOUNDS,
    SCALE_RULES,
    alpha_of,
    attention_scale,
    canonical,
    learns_scale,
)

PROJECTIONS: tuple[str, ...] = ("baseline", "q-identity", "k-identity", "v-identity", "nonlinear-q")
# gelu_tanh: the tanh approximation GPT-2 was trained with (Hugging Face "gelu_new").
ACTIVATIONS: tuple[str, ...] = ("gelu", "relu", "gelu_tanh")
# "gelu": two matrices with `activation` between them (GPT-2's MLP; GELU unless `activation`
# says otherwise). "swiglu": down(silu(gate x) * up x), Llama's gated MLP, three matrices.
MLPS: tuple[str, ...] = ("gelu", "swiglu")
NORMS: tuple[str, ...] = ("layernorm", "rmsnorm", "none")
POSITIONS: tuple[str, ...] = ("learned", "rope", "none")
# "full": x + attn(n1 x), then + mlp(n2 x) (GPT-2). "attention": skip around attention only,
# X_{l+1} = MLP(X_l + MHA(X_l)) (docs/paper.md section 2.2). "none": no skips at all.
RESIDUALS: tuple[str, ...] = ("full", "attention", "none")
# How softmax(q k^T * scale) v is computed (the names Hugging Face uses): "sdpa", PyTorch's
# scaled_dot_product_attention (flash/memory-efficient kernels, fp32 scores); "eager", plain
# matmuls with the T x T scores in the matmul dtype (model/attention_kernels.py); "auto", the
# kernel DEFAULT_ATTN_IMPL names for where the model runs.
ATTN_IMPLS: tuple[str, ...] = ("auto", "sdpa", "eager")
# attn_impl = "auto": the kernel measured fastest, by device type, dtype, CPU kind
# (model/cpu_kind.py; None off the CPU) and the context attended over: each entry holds up to
# the longest context it names (None: any), the entry with the shortest such bound that covers
# the model's context wins. benchmarks/README.md ("What attn_impl = "auto" picks") shows the
# measurements. What is not listed gets SDPA, which every device has and every run before
# this table trained with. (Generation with a KV cache takes SDPA whatever the kernel: gpt.py.)
DEFAULT_ATTN_IMPL: dict[tuple[str, str, str | None, int | None], str] = {
    ("cpu", "bf16", "amx", 256): "eager",
    ("cpu", "bf16", "amx", None): "sdpa",
    ("cpu", "fp32", "amx", None): "sdpa",
    ("cpu", "fp32", "avx2", 128): "eager",
    ("cpu", "fp32", "avx2", None): "sdpa",
}
# What a key of a saved [model] table (a run's config.toml, a checkpoint's state.json) means
# when the version that wrote it left it out or wrote null: attn_scale was null for "paper"
# before it took rule names, and runs saved before attn_impl = "auto" ran on SDPA.
SAVED_DEFAULTS: dict[str, Any] = {"attn_scale": "paper", "attn_impl": "sdpa"}
# Of those, the keys that records written before the rule names stored as null, as sweep
# fingerprints still hash them (experiments/spec.py).
NULL_IN_OLD_RECORDS: tuple[str, ...] = ("attn_scale",)
# model.parametrization (model/parametrization.py holds what each one does)
PARAMETRIZATIONS: tuple[str, ...] = ("standard", "mup")
# model.depth_scaling -> alpha, the exponent of the residual branch multiplier (L0 / L)^alpha
DEPTH_ALPHA: dict[str, float] = {"none": 0.0, "depth-mup": 0.5, "completep": 1.0}
# model.attn_zero_init: which logit factor's weight starts at zero, so that attention starts
# uniform (μP's zero query; where the query is the identity the key is the nearest analogue)
ZERO_INITS: tuple[str, ...] = ("none", "query", "key")
# Keys added after sweeps were archived, at the values that mean what those sweeps ran: a
# fingerprint leaves them out at these values, so it stays what it was (experiments/spec.py).
FINGERPRINT_NEUTRAL: dict[str, Any] = {"parametrization": "standard", "base_width": None,
                                       "base_depth": None, "depth_scaling": None,
                                       "attn_zero_init": "none"}
# depth_scaling unset: none under "standard"; under "mup" the rule whose activations and
# updates the coordinate check found flat from 2 to 16 layers (docs/theory.md section 7)
DEFAULT_DEPTH_SCALING: dict[str, str] = {"standard": "none", "mup": "completep"}


def kernel_for(attn_impl: str, device_type: str, dtype: str, context: int,
               cpu: str | None = None) -> str:
    """The attention kernel `attn_impl` means on a device of `device_type` ("cpu", "cuda") in
    `dtype` ("bf16" or "fp32", the matmuls' dtype) for a model of `context` positions (its
    block_size); `cpu`, the CPU kind, defaults to this machine's (model/cpu_kind.py)."""
    if attn_impl != "auto":
        return attn_impl
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"kernel_for wants the dtype bf16 or fp32, got {dtype!r}")
    cpu = (cpu or cpu_kind()) if device_type == "cpu" else None
    covering = [(bound, kernel) for (dev, dt, kind, bound), kernel in DEFAULT_ATTN_IMPL.items()
                if (dev, dt, kind) == (device_type, dtype, cpu)
                and (bound is None or context <= bound)]
    if not covering:
        return "sdpa"
    return min(covering, key=lambda entry: math.inf if entry[0] is None else entry[0])[1]


def migrate_model_table(table: Any) -> Any:
    """A saved [model] table in today's terms: each SAVED_DEFAULTS key it lacks (or holds as
    null) gets the value it meant when it was written. Anything but a table is returned as it
    is, for from_dict to refuse."""
    if not isinstance(table, dict):
        return table
    return {**table, **{k: v for k, v in SAVED_DEFAULTS.items() if table.get(k) is None}}


def old_record_nulls(table: dict[str, Any]) -> dict[str, Any]:
    """The inverse for fingerprints: a NULL_IN_OLD_RECORDS key holding its saved default is
    written as null, as records made before the rule names hold it, and a FINGERPRINT_NEUTRAL
    key at its neutral value is left out, as records made before it existed lack it."""
    kept = {k: v for k, v in table.items()
            if not (k in FINGERPRINT_NEUTRAL and v == FINGERPRINT_NEUTRAL[k])}
    return {**kept, **{k: None for k in NULL_IN_OLD_RECORDS
                       if table.get(k) == SAVED_DEFAULTS[k]}}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite int or float (not a bool), else None. An integer
    too large for a double (TOML and JSON read 1 followed by 400 zeros exactly) is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def shown(value: Any) -> str:
    """`value` for an error message: an integer too long to print is given by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def checked_scale_setting(setting: Any, projection: str, d: int, d_k: int, init_std: float,
                          name: str = "attn_scale") -> float | str:
    """`setting` (an attention scale setting called `name`) in its one spelling, or a one-line
    refusal: it must be a rule, A/sqrt(d_k) or a finite number (not a bool), and the scale it
    gives this shape must lie in SCALE_BOUNDS. The one check of a config's model.attn_scale
    and of hf.identity_query's scale=."""
    low, high = SCALE_BOUNDS
    if isinstance(setting, str):
        learns_scale(setting)  # refuses a name that is not a rule, listing the rules
        setting = canonical(setting)
        scale = attention_scale(setting, projection, d, d_k, init_std)
        fix = ("a smaller A" if alpha_of(setting) is not None
               else f"init_std nearer 0.02 or {name} to a number")
        require(low <= scale <= high,
                f"{name} = {setting} gives {scale:.3g} for this shape (init_std="
                f"{init_std:g}), outside [{low:g}, {high:g}]: set {fix}")
        return setting
    number = finite_number(setting)
    require(number is not None and low <= number <= high,
            f"{name} must be a number in [{low:g}, {high:g}], A/sqrt(d_k) or one "
            f"of {', '.join(SCALE_RULES)}, got {shown(setting)}")
    # one spelling for one scale: 1 and 1.0 must hash alike in sweep fingerprints
    return number


@dataclass(frozen=True)
class ModelConfig:
    """Shape and layout of a GPT (causal) or encoder (bidirectional) transformer.

    Frozen: a changed config is `dataclasses.replace(cfg, ...)`, which validates it again.
    """

    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    vocab_size: int = 65
    n_kv_head: int | None = None  # GQA/MQA; None means n_head
    head_dim: int | None = None  # None means n_embd // n_head
    mlp_hidden: int | None = None  # None: see `hidden`
    mlp_ratio: float = 4.0
    mlp: str = "gelu"  # see MLPS
    bias: bool = False
    dropout: float = 0.0
    tie_embeddings: bool = True
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float | None = None  # None: torch's default (LayerNorm 1e-5, RMSNorm dtype eps)
    positions: str = "learned"
    rope_base: float = 10000.0
    residual: str = "full"
    share_layers: bool = False  # one block applied n_layer times (ALBERT-style)
    causal: bool = True  # False: bidirectional encoder
    projection: str = "baseline"
    # a number, "A/sqrt(d_k)", or a rule of model/scale.py's SCALE_RULES. The default is the
    # standard 1/sqrt(d_k) for every scheme: the paper's halving for an identity query or key
    # ("paper", its labelled recipe) cost 5-8% at d = 128 (docs/results/english-scale)
    attn_scale: float | str = "standard"
    attn_impl: str = "auto"  # see ATTN_IMPLS
    init_std: float = 0.02
    # how init, lr and decay scale with the shape (model/parametrization.py): "standard" or
    # "mup", relative to the base shape (None: this model's own width / depth)
    parametrization: str = "standard"
    base_width: int | None = None
    base_depth: int | None = None
    depth_scaling: str | None = None  # none | depth-mup | completep; None: DEFAULT_DEPTH_SCALING
    attn_zero_init: str = "none"  # none | query | key: that logit factor's weight starts at 0

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived quantities -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's hidden width: mlp_hidden, else mlp_ratio * d for the GELU MLP; for SwiGLU
        (three matrices, not two) 2/3 of that, rounded to a multiple of 64, so that the default
        mlp_ratio 4 keeps a 4d GELU MLP's parameter count (d = 384: 1,024)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "swiglu":
            return max(64, 64 * int(round(2 / 3 * self.mlp_ratio * self.n_embd / 64)))
        return int(round(self.mlp_ratio * self.n_embd))

    @property
    def mlp_matrices(self) -> int:
        """d x hidden matrices per MLP: 2 (up, down) or 3 (gate, up, down)."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def learned_scale(self) -> bool:
        """One learnable gain per head multiplies `scale` (initialised at 1)."""
        return learns_scale(self.attn_scale)

    @property
    def scale(self) -> float:
        """The attention logit scale (for "learned": its initial value, before the gains)."""
        return attention_scale(self.attn_scale, self.projection, self.n_embd, self.d_head,
                               self.init_std)

    @property
    def depth_rule(self) -> str:
        """The depth scaling in force (depth_scaling, or its default for the parametrization)."""
        return self.depth_scaling or DEFAULT_DEPTH_SCALING[self.parametrization]

    @property
    def alpha(self) -> float:
        """The scale over the standard 1/sqrt(d_k): the coordinate of the scale scans."""
        return self.scale * math.sqrt(self.d_head)

    def on_device(self, device_type: str, dtype: str) -> ModelConfig:
        """This config with attn_impl = "auto" made the kernel of `device_type` and `dtype`
        at its block_size on this machine (what a run records, so that its resume and
        fingerprint see it)."""
        kernel = kernel_for(self.attn_impl, device_type, dtype, self.block_size)
        return self if kernel == self.attn_impl else dataclasses.replace(self, attn_impl=kernel)

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        """Refuse a config no model can be built from, with one line naming the fix."""
        try:
            self._check_sizes()
            self._check_choices()
            self._check_attn_scale()
            self._check_shapes()
        except QkvlabError as exc:
            raise QkvlabError(f"invalid model config: {exc}") from None

    def _check_sizes(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            require(_positive_int(value), f"{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_head", "head_dim", "mlp_hidden", "base_width", "base_depth"):
            value = getattr(self, name)
            require(value is None or _positive_int(value),
                  f"{name} must be a positive integer or unset, got {value!r}")
        require(self.n_layer <= 1024 and self.n_embd <= 65536 and self.block_size <= 1 << 20,
              f"sizes are absurd (n_layer={self.n_layer}, n_embd={self.n_embd}, "
              f"block_size={self.block_size}); check the config")
        require(self.vocab_size <= 1 << 24, f"vocab_size={self.vocab_size} is absurd")
        for name in ("mlp_ratio", "dropout", "init_std", "rope_base", "norm_eps"):
            value = getattr(self, name)
            require((value is None and name == "norm_eps") or finite_number(value) is not None,
                    f"{name} must be a finite number, got {shown(value)}")
        require(0.0 < float(self.mlp_ratio) <= 64.0,
              f"mlp_ratio must be in (0, 64], got {self.mlp_ratio!r}")
        require(0.0 <= float(self.dropout) < 1.0,
              f"dropout must be in [0, 1), got {self.dropout!r}")
        require(float(self.init_std) > 0.0, f"init_std must be > 0, got {self.init_std!r}")
        require(float(self.rope_base) > 1.0, f"rope_base must be > 1, got {self.rope_base!r}")
        require(self.norm_eps is None or 0.0 < float(self.norm_eps) < 1.0,
              f"norm_eps must be in (0, 1) or unset, got {self.norm_eps!r}")

    def _check_choices(self) -> None:
        for name, allowed in (("projection", PROJECTIONS), ("activation", ACTIVATIONS),
                              ("mlp", MLPS), ("norm", NORMS), ("positions", POSITIONS),
                              ("residual", RESIDUALS), ("attn_impl", ATTN_IMPLS),
                              ("parametrization", PARAMETRIZATIONS),
                              ("attn_zero_init", ZERO_INITS)):
            value = getattr(self, name)
            require(value in allowed, f"{name}={value!r} is not one of {', '.join(allowed)}")
        require(self.depth_scaling is None or self.depth_scaling in DEPTH_ALPHA,
                f"depth_scaling={self.depth_scaling!r} is not one of {', '.join(DEPTH_ALPHA)}")
        zeroed = {"query": ("q-identity", "nonlinear-q"), "key": ("k-identity",)}
        require(self.projection not in zeroed.get(self.attn_zero_init, ()),
                f"attn_zero_init={self.attn_zero_init!r} needs a learned W_"
                f"{self.attn_zero_init[0].upper()}, which projection={self.projection} has not: "
                f"use attn_zero_init = \"{'key' if self.attn_zero_init == 'query' else 'query'}\"")

    def _check_attn_scale(self) -> None:
        object.__setattr__(self, "attn_scale", checked_scale_setting(
            self.attn_scale, self.projection, self.n_embd, self.d_head, self.init_std))

    def _check_shapes(self) -> None:
        h, hkv, dk, d = self.n_head, self.kv_heads, self.d_head, self.n_embd
        require(self.head_dim is not None or d % h == 0,
              f"n_embd ({d}) must be divisible by n_head ({h}) unless head_dim is set")
        require(h % hkv == 0,
              f"n_head ({h}) must be divisible by n_kv_head ({hkv}) for grouped-query attention")
        if self.projection in ("q-identity", "k-identity", "v-identity"):
            which = self.projection[0].upper()
            require(h * dk == d,
                  f"projection={self.projection} needs n_head * head_dim == n_embd "
                  f"(the identity W_{which} is d x d), got {h} * {dk} != {d}")
        if self.projection in ("k-identity", "v-identity"):
            require(hkv == h,
                  f"projection={self.projection} needs n_kv_head == n_head (under GQA only W_Q "
                  f"is square), got n_kv_head={hkv}, n_head={h}")
        if self.projection == "nonlinear-q":
            require(h * dk == d,
                  f"projection=nonlinear-q needs n_head * head_dim == n_embd "
                  f"(Q(X) = (X + f(X))/2), got {h} * {dk} != {d}")
            require(d % 2 == 0, f"projection=nonlinear-q needs an even n_embd, got {d}")
        if self.positions == "rope":
            require(dk % 2 == 0, f"positions=rope needs an even head_dim, got {dk}")

    # ---- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelConfig:
        """Build from plain data (a TOML table), refusing unknown keys and wrong types."""
        return from_table(cls, data, where)


def from_table(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a TOML table, refusing unknown keys and wrong types; every
    config section (model here, data/optim/train in train.config) is read this one way."""
    if not isinstance(data, dict):
        raise QkvlabError(f"[{where}] must be a table of key = value pairs, got {data!r}")
    valid = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise QkvlabError(
            f"unknown key(s) {', '.join(unknown)} in [{where}]; valid keys: {', '.join(valid)}"
        )
    kwargs = {key: coerce(value, valid[key].type, f"{where}.{key}") for key, value in data.items()}
    return cls(**kwargs)


def coerce(value: Any, type_str: Any, where: str) -> Any:
    """Check a TOML value against a dataclass field's annotation (a string under PEP 563)."""
    t = str(type_str).replace(" ", "")
    optional = t.endswith("|None")
    base = t.removesuffix("|None")
    if value is None:
        if optional:
            return None
        raise QkvlabError(f"{where} must not be empty")
    bad = QkvlabError(f"{where} must be {base.replace('Literal', 'one of ')}, got {shown(value)}")
    if base == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        if not -(1 << 63) <= value < 1 << 63:  # tomllib reads any size; torch and numpy do not
            raise QkvlabError(f"{where} must fit in 64 bits, got {shown(value)}")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        number = finite_number(value)
        if number is None:  # TOML has nan and inf literals, and integers of any size
            raise QkvlabError(f"{where} must be a finite number, got {shown(value)}")
        return number
    if base == "str":
        if not isinstance(value, str):
            raise bad
        if "\0" in value:  # no path, name or choice contains NUL; os calls would choke on it
            raise QkvlabError(f"{where} must not contain a NUL character, got {value!r}")
        return value
    if base.startswith("list"):
        if not isinstance(value, list):
            raise bad
        return value
    return value
