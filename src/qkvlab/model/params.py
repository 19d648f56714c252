"""Exact parameter accounting and FLOPs per token, computed from the config alone.

Counting from the config (not from an instantiated model) makes a 124M-parameter dry run free;
tests check these formulas against `sum(p.numel())` of real models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from qkvlab.model.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameters by component. `non_embedding` excludes token/position tables and the head."""

    token_embedding: int
    position_embedding: int
    head: int  # 0 when tied to the token embedding
    attn_q: int
    attn_k: int
    attn_v: int
    attn_o: int
    query_map: int  # the nonlinear query's f (section 6); 0 otherwise
    logit_gain: int  # one learnable logit scale per head with attn_scale = "learned"; else 0
    mlp: int
    norms: int

    @property
    def attention(self) -> int:
        return (self.attn_q + self.attn_k + self.attn_v + self.attn_o + self.query_map
                + self.logit_gain)

    @property
    def embedding(self) -> int:
        return self.token_embedding + self.position_embedding + self.head

    @property
    def non_embedding(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding

    def as_dict(self) -> dict[str, int]:
        out = asdict(self)
        out.update(attention=self.attention, embedding=self.embedding,
                   non_embedding=self.non_embedding, total=self.total)
        return out


def _norm_params(cfg: ModelConfig) -> int:
    if cfg.norm == "layernorm":
        return cfg.n_embd * (2 if cfg.bias else 1)
    if cfg.norm == "rmsnorm":
        return cfg.n_embd
    return 0


def count_params(cfg: ModelConfig) -> ParamCount:
    d, dk, V = cfg.n_embd, cfg.d_head, cfg.vocab_size
    q_dim, kv_dim = cfg.n_head * dk, cfg.kv_heads * dk
    b = 1 if cfg.bias else 0

    def linear(n_in: int, n_out: int, bias: bool = cfg.bias) -> int:
        return n_in * n_out + (n_out if bias else 0)

    blocks = 1 if cfg.share_layers else cfg.n_layer
    p = cfg.projection
    attn_q = 0 if p in ("q-identity", "nonlinear-q") else linear(d, q_dim)
    attn_k = 0 if p == "k-identity" else linear(d, kv_dim)
    attn_v = 0 if p == "v-identity" else linear(d, kv_dim)
    # f: RMSNorm gain, d x d/2, d/2 x d (no biases), LayerNorm gain (+ bias with bias=True)
    query_map = (d + d * (d // 2) + (d // 2) * d + d * (1 + b)) if p == "nonlinear-q" else 0
    return ParamCount(
        token_embedding=V * d,
        position_embedding=cfg.block_size * d if cfg.positions == "learned" else 0,
        head=0 if cfg.tie_embeddings else V * d,
        attn_q=blocks * attn_q,
        attn_k=blocks * attn_k,
        attn_v=blocks * attn_v,
        attn_o=blocks * linear(q_dim, d),
        query_map=blocks * query_map,
        logit_gain=blocks * cfg.n_head if cfg.learned_scale else 0,
        mlp=blocks * ((cfg.mlp_matrices - 1) * linear(d, cfg.hidden) + linear(cfg.hidden, d)),
        norms=(2 * blocks + 1) * _norm_params(cfg),
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token, counting shared blocks once per use."""
    c = count_params(cfg)
    per_use = cfg.n_layer if cfg.share_layers else 1
    # the head is always a matmul, tied or not; embeddings are lookups
    return per_use * (c.attention - c.logit_gain + c.mlp) + cfg.vocab_size * cfg.n_embd


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, training: bool = True) -> float:
    """FLOPs per token, PaLM-style: 6N + 12 L H dk T for training (forward 2N + 4 L H dk T).

    N counts matmul weights (a model whose W_Q is the identity has fewer), T the context.
    """
    T = seq_len or cfg.block_size
    attn = 2 * cfg.n_layer * cfg.n_head * cfg.d_head * T  # QK^T and AV, forward, per token
    forward = 2 * matmul_params(cfg) + 2 * attn
    return 3 * forward if training else forward
