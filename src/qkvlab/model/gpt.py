"""The transformer: GPT (causal) or encoder (bidirectional), with a switchable Q/K/V scheme.

Reading order: `Attention` (where the projection scheme lives), `MLP`, `Block`, `GPT`.
Shapes: B batch, T time, d = n_embd, H heads, Hkv key/value heads, dk head size.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn

from qkvlab.errors import require
from qkvlab.model.attention_kernels import eager_attention
from qkvlab.model.attention_layout import AttentionLayout, Projections
from qkvlab.model.config import ModelConfig, kernel_for
from qkvlab.model.parametrization import (
    base_std,
    parameter_table,
    readout_multiplier,
)


def make_norm(kind: str, dim: int, bias: bool, eps: float | None = None) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, bias=bias, eps=1e-5 if eps is None else eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    return nn.Identity()


class NonlinearQuery(nn.Module):
    """f(X) = LN(GELU(RMSNorm(X) W1) W2), W1: d x d/2, W2: d/2 x d (docs/paper.md section 6).

    Same parameter budget as a d x d W_Q, plus two gains. The query is (X + f(X)) / 2.
    """

    def __init__(self, d: int, bias: bool):
        super().__init__()
        self.norm_in = nn.RMSNorm(d)
        self.fc_in = nn.Linear(d, d // 2, bias=False)
        self.fc_out = nn.Linear(d // 2, d, bias=False)
        self.norm_out = nn.LayerNorm(d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_out(self.fc_out(F.gelu(self.fc_in(self.norm_in(x)))))


class KVCache:
    """Pre-allocated keys/values for incremental decoding, one slot per layer application."""

    def __init__(self, cfg: ModelConfig, batch_size: int, device, dtype):
        shape = (batch_size, cfg.kv_heads, cfg.block_size, cfg.d_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]

    def bytes_per_token(self) -> int:
        k = self.k[0]
        per_layer = 2 * k.shape[1] * k.shape[3] * k.element_size()
        return per_layer * len(self.k)


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.d_head // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(half, device=device).float() / half))
    angles = torch.outer(torch.arange(cfg.block_size, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()  # (T, dk/2) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + dk/2) of x (B, H, T, dk) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention whose Q, K or V projection may be the identity.

    `cfg.projection` decides, in this one place, where each of q, k, v comes from:
      baseline      q, k, v = x W_Q, x W_K, x W_V           (one fused matmul)
      q-identity    q = x (head h reads slice h of x: a view, no matmul, no copy); k, v fused
      k-identity    k = x; q, v fused            v-identity    v = x; q, k fused
      nonlinear-q   q = (x + f(x)) / 2; k, v fused
    The logits are q k^T * cfg.scale; with attn_scale = "learned", head h's are further
    multiplied by its own learnable gain (logit_gain[h], initialised at 1).
    Outside the model, read and write W_Q, W_K, W_V with `projections` / `load_projections`
    (never by cutting in_proj), and take the logits or weights from `scores` / `probabilities`.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.projection = cfg.projection
        self.n_head, self.n_kv_head, self.d_head = cfg.n_head, cfg.kv_heads, cfg.d_head
        self.scale = cfg.scale
        q_dim = self.n_head * self.d_head
        self.layout = AttentionLayout.of(cfg)  # which rows of in_proj hold W_Q, W_K, W_V
        self.sizes = self.layout.sizes
        self.in_proj = nn.Linear(cfg.n_embd, sum(self.sizes), bias=cfg.bias)
        self.out_proj = nn.Linear(q_dim, cfg.n_embd, bias=cfg.bias)
        self.query_map = NonlinearQuery(cfg.n_embd, cfg.bias) if cfg.projection == "nonlinear-q" \
            else None
        self.logit_gain = nn.Parameter(torch.ones(self.n_head)) if cfg.learned_scale else None
        self.dropout = cfg.dropout

    def heads(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
              start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, dk), k and v (B, Hkv, T, dk) for the normed input x (B, T, d): the
        logits are q k^T * self.scale (any learned per-head gain is already in q)."""
        B, T, _ = x.shape
        x_norm = x  # fp32 under autocast: the nonlinear query's own norms want it that way
        if torch.is_autocast_enabled(x.device.type):
            # Cast once here: an identity query (or key/value) then shares the matmul's bf16
            # input instead of paying a second cast, forward and backward.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        proj = self.in_proj(x)
        q, k, v = proj.split(self.sizes, dim=-1)
        if self.projection == "q-identity":
            q = x
        elif self.projection == "nonlinear-q":
            q = 0.5 * (x_norm + self.query_map(x_norm))
        elif self.projection == "k-identity":
            k = x
        elif self.projection == "v-identity":
            v = x
        # The nonlinear query ends in an fp32 LayerNorm under autocast: use one dtype for SDPA
        # (.to is a no-op when they already agree).
        q, k, v = q.to(proj.dtype), k.to(proj.dtype), v.to(proj.dtype)
        q = q.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, dk), a view
        k = k.view(B, T, self.n_kv_head, self.d_head).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.d_head).transpose(1, 2)
        if self.logit_gain is not None:  # a per-head factor on q is one on that head's logits
            q = q * self.logit_gain.to(q.dtype).view(1, -1, 1, 1)
        if rope is not None:
            cos, sin = rope[0][start_pos:start_pos + T], rope[1][start_pos:start_pos + T]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def projections(self) -> Projections:
        """W_Q, W_K, W_V and their biases as views of in_proj, nn.Linear's (out, in); None for
        an identity projection (and the nonlinear query's W_Q). Write with load_projections."""
        return self.layout.split(self.in_proj.weight, self.in_proj.bias)

    @torch.no_grad()
    def load_projections(self, parts: Projections) -> None:
        """Copy every part `parts` holds into in_proj (cast to its dtype); the parts it leaves
        None keep their values. A part this attention does not have is refused."""
        current = self.projections()
        for name in (f.name for f in fields(Projections)):
            new, slot = getattr(parts, name), getattr(current, name)
            if new is None:
                continue
            require(slot is not None, f"{name} given, but this attention has none "
                                      f"(projection={self.projection}, bias={self.cfg.bias})")
            require(new.shape == slot.shape,
                    f"{name} must be {tuple(slot.shape)}, got {tuple(new.shape)}")
            slot.copy_(new)

    def allowed(self, T: int, device: torch.device | None = None) -> torch.Tensor:
        """(T, T) bool: query i may attend to key j (j <= i when causal)."""
        every = torch.ones(T, T, dtype=torch.bool, device=device)
        return every.tril() if self.cfg.causal else every

    def scores(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               *, masked: bool = True) -> torch.Tensor:
        """The logits forward's softmax sees, (B, H, T, T), for the normed input x (B, T, d):
        q k^T * scale, with any learned gain and RoPE, each query head against its key head;
        with `masked`, the pairs outside `allowed` are -inf."""
        q, k, _ = self.heads(x, rope)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        logits = q @ k.transpose(-2, -1) * self.scale
        if not masked:
            return logits
        return logits.masked_fill(~self.allowed(x.shape[1], x.device), float("-inf"))

    def probabilities(self, x: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The attention weights (B, H, T, T) forward applies to v (without dropout)."""
        return self.scores(x, rope).softmax(-1)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        start_pos: int = 0,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.heads(x, rope, start_pos)
        dtype = v.dtype
        mask, is_causal = None, self.cfg.causal
        if cache is not None:
            end = start_pos + T
            cache.k[layer][:, :, start_pos:end] = k
            cache.v[layer][:, :, start_pos:end] = v
            k, v = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]
            q = q.to(k.dtype)  # the cache may hold a wider dtype than the weights (new_cache)
            if self.cfg.causal and start_pos > 0:
                # Queries sit at positions start_pos..end-1; SDPA's is_causal would align the
                # mask to the top-left corner, which is wrong once keys outnumber queries.
                is_causal = False
                if T > 1:
                    qpos = torch.arange(start_pos, end, device=x.device)[:, None]
                    mask = qpos >= torch.arange(end, device=x.device)[None, :]
        # "auto" is decided here, by the device and dtype the input is on (and the model's
        # context, as when a run records its kernel: config.on_device). Generation with a KV
        # cache takes SDPA whatever the kernel: eager's edge is bf16 scores in training, and on
        # the CPU the cache keeps attention in fp32, where SDPA's fused kernel measured faster
        # at prefill and at every decoding step (benchmarks/README.md).
        kernel = kernel_for(self.cfg.attn_impl, q.device.type,
                            "bf16" if q.dtype == torch.bfloat16 else "fp32", self.cfg.block_size)
        eager = kernel == "eager" and cache is None
        attend = eager_attention if eager else F.scaled_dot_product_attention
        y = attend(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and mask is None,
            scale=self.scale,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        y = y.to(dtype).transpose(1, 2).reshape(B, T, self.n_head * self.d_head)
        return F.dropout(self.out_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """fc_out(act(fc_in x)) (mlp = "gelu"), or SwiGLU fc_out(silu(gate x) * up x) with the gate
    and up matrices fused into fc_in ([gate | up], one matmul) (mlp = "swiglu")."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.fc_in = nn.Linear(cfg.n_embd, (2 if self.gated else 1) * cfg.hidden, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.bias)
        self.act = nn.SiLU() if self.gated else {
            "gelu": nn.GELU, "relu": nn.ReLU,
            "gelu_tanh": lambda: nn.GELU(approximate="tanh")}[cfg.activation]()
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return F.dropout(self.fc_out(h), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.residual = cfg.residual
        self.norm1 = make_norm(cfg.norm, cfg.n_embd, cfg.bias, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg.norm, cfg.n_embd, cfg.bias, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope=None, cache=None, layer=0, start_pos=0):
        a = self.attn(self.norm1(x), rope, cache, layer, start_pos)
        if self.residual == "full":
            x = x + a
            return x + self.mlp(self.norm2(x))
        if self.residual == "attention":  # X_{l+1} = MLP(X_l + MHA(X_l))
            return self.mlp(self.norm2(x + a))
        return self.mlp(self.norm2(a))


class GPT(nn.Module):
    """Token (+ position) embedding, n_layer blocks, final norm, language-model head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        n_blocks = 1 if cfg.share_layers else cfg.n_layer
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_blocks))
        self.norm_f = make_norm(cfg.norm, cfg.n_embd, cfg.bias, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.readout_mult = readout_multiplier(cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Matrices and tables N(0, std), std from the parametrization's table (init_std, or
        GPT-2's init_std / sqrt(2 L) on residual outputs, times the μP factors); gains 1,
        biases 0; with attn_zero_init, W_Q (or W_K) 0. The draws keep the order of GPT-2's
        init (residual outputs drawn twice), so a seed gives the weights it always gave."""
        stds = {id(self.get_parameter(r.name)): base_std(self.cfg, r.name) * r.scaling.init
                for r in parameter_table(self, self.cfg)}
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, 0.0, stds[id(module.weight)])
            if isinstance(module, nn.Linear | nn.LayerNorm | nn.RMSNorm):
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm | nn.RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
        for block in self.blocks:
            for proj in (block.attn.out_proj, block.mlp.fc_out):
                nn.init.normal_(proj.weight, 0.0, stds[id(proj.weight)])
            if self.cfg.attn_zero_init != "none":  # uniform attention at init
                w = block.attn.projections()
                (w.w_q if self.cfg.attn_zero_init == "query" else w.w_k).detach().zero_()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of final-norm output h: the LM head, after the readout multiplier a
        tied head carries under μP (a constant, skipped where it is 1)."""
        if self.readout_mult != 1.0:
            h = h * self.readout_mult
        return self.lm_head(h)

    def layers(self):
        """(layer index, block) for each of the n_layer applications (shared blocks repeat)."""
        for i in range(self.cfg.n_layer):
            yield i, self.blocks[0 if self.cfg.share_layers else i]

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None,
                      start_pos: int = 0) -> torch.Tensor:
        """Final-norm output (B, T, d) for token ids idx (B, T)."""
        B, T = idx.shape
        if start_pos + T > self.cfg.block_size:
            raise ValueError(
                f"sequence of {start_pos + T} tokens exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start_pos, start_pos + T, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos, self.rope_sin) if self.cfg.positions == "rope" else None
        for i, block in self.layers():
            x = block(x, rope, cache, i, start_pos)
        return self.norm_f(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        start_pos: int = 0,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) (or (B, 1, V) with last_only) and, given targets, the mean loss.

        Targets equal to -100 are ignored (masked-LM and padding).
        """
        h = self.hidden_states(idx, cache, start_pos)
        if last_only and targets is None:
            h = h[:, -1:]
        logits = self.head(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache. Default dtype: the weights', except bf16/fp16 weights on CPU get
        an fp32 cache: there, SDPA's single-query kernel is ~4x slower in bf16 than in fp32
        (measured at 256 keys; in bf16 it took a fifth of a batch-1 decoding step and three
        quarters at batch 16). fp32 doubles the cache's bytes (see bytes_per_token)."""
        p = self.lm_head.weight
        if dtype is None:
            dtype = torch.float32 if p.device.type == "cpu" and p.dtype in (
                torch.bfloat16, torch.float16) else p.dtype
        return KVCache(self.cfg, batch_size, p.device, dtype)
