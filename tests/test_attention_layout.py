"""The attention owns its fused in_proj layout (projections / load_projections, AttentionLayout)
and its logits (scores / probabilities): round trips, absent identities, GQA shapes, refusals,
and the scores against what forward computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkvlab.errors import QkvlabError
from qkvlab.hf.gpt2 import from_gpt2, to_gpt2
from qkvlab.hf.llama import from_llama, to_llama
from qkvlab.model.attention_layout import AttentionLayout, Projections
from qkvlab.model.config import PROJECTIONS, ModelConfig
from qkvlab.model.gpt import GPT, Attention, rope_tables

F64 = torch.float64
# every projection scheme, and the variants that change q or k after the projections
SCHEMES = [dict(projection=p) for p in PROJECTIONS] + [
    dict(n_kv_head=2), dict(n_kv_head=1, projection="q-identity"), dict(positions="rope"),
    dict(positions="rope", n_kv_head=2, projection="nonlinear-q"), dict(attn_scale="learned"),
    dict(attn_scale="learned", projection="q-identity", positions="rope"),
    dict(causal=False), dict(causal=False, projection="k-identity"), dict(bias=False),
]
ABSENT = {"baseline": "", "q-identity": "q", "nonlinear-q": "q", "k-identity": "k",
          "v-identity": "v"}


def cfg_of(**kw) -> ModelConfig:
    base = dict(n_layer=1, n_head=4, n_embd=32, block_size=12, vocab_size=40, bias=True,
                attn_impl="sdpa")
    return ModelConfig(**{**base, **kw})


def random_attention(cfg: ModelConfig, seed: int = 0) -> Attention:
    """A float64 attention with every parameter (gains and biases too) off its init."""
    torch.manual_seed(seed)
    attn = Attention(cfg).to(F64).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.4 + (1.0 if p.dim() == 1 else 0.0))
    return attn


def rope_for(cfg: ModelConfig):
    if cfg.positions != "rope":
        return None
    return tuple(t.to(F64) for t in rope_tables(cfg))


def inputs(cfg: ModelConfig, seed: int = 1, T: int = 9) -> torch.Tensor:
    return torch.randn(2, T, cfg.n_embd, generator=torch.Generator().manual_seed(seed),
                       dtype=F64)


@pytest.mark.parametrize("kw", SCHEMES, ids=str)
def test_projections_round_trip_into_a_fresh_attention(kw):
    cfg = cfg_of(**kw)
    src = random_attention(cfg, 0)
    dst = random_attention(cfg, 1)  # different everything; then copy all but in_proj
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if not name.startswith("in_proj."):
                p.copy_(dict(src.named_parameters())[name])
    x, rope = inputs(cfg), rope_for(cfg)
    with torch.no_grad():
        assert not torch.equal(dst(x, rope), src(x, rope))
        dst.load_projections(src.projections())
        assert torch.equal(dst.in_proj.weight, src.in_proj.weight)
        assert torch.equal(dst(x, rope), src(x, rope))


@pytest.mark.parametrize("kw", SCHEMES, ids=str)
def test_fuse_inverts_split_and_the_state_matches_the_module(kw):
    cfg = cfg_of(**kw)
    attn = random_attention(cfg)
    layout = AttentionLayout.of(cfg)
    assert layout == attn.layout
    weight, bias = layout.fuse(attn.projections())
    assert torch.equal(weight, attn.in_proj.weight)
    assert (bias is None) == (not cfg.bias)
    if cfg.bias:
        assert torch.equal(bias, attn.in_proj.bias)
    state = layout.state(attn.projections(), "blocks.0.attn.")
    model_keys = {k for k in GPT(cfg).state_dict() if ".in_proj." in k}
    assert set(state) == model_keys


@pytest.mark.parametrize("kw", SCHEMES, ids=str)
def test_identity_parts_are_absent_and_shapes_follow_the_heads(kw):
    cfg = cfg_of(**kw)
    parts = Attention(cfg).projections()
    absent = ABSENT[cfg.projection]
    shapes = {"q": (cfg.n_head * cfg.d_head, cfg.n_embd),
              "k": (cfg.kv_heads * cfg.d_head, cfg.n_embd),
              "v": (cfg.kv_heads * cfg.d_head, cfg.n_embd)}
    for n in "qkv":
        w, b = parts.weight(n), parts.bias(n)
        if n == absent:
            assert w is None and b is None
            assert AttentionLayout.of(cfg).shape(n) is None
            continue
        assert tuple(w.shape) == shapes[n] == AttentionLayout.of(cfg).shape(n)
        assert (b is None) == (not cfg.bias)
        if b is not None:
            assert tuple(b.shape) == (shapes[n][0],)
    assert AttentionLayout.of(cfg).kept == tuple(n for n in "qkv" if n != absent)


def test_gqa_shapes_and_views():
    cfg = cfg_of(n_head=4, n_kv_head=2, n_embd=32)
    attn = Attention(cfg)
    parts = attn.projections()
    assert parts.w_q.shape == (32, 32) and parts.w_k.shape == parts.w_v.shape == (16, 32)
    assert parts.b_k.shape == (16,)
    # views, not copies: they follow in_proj (row 40 is row 8 of W_K)
    with torch.no_grad():
        attn.in_proj.weight[40, 3] = 7.0
    assert float(parts.w_k[8, 3].detach()) == 7.0


def test_load_projections_writes_only_what_it_is_given():
    attn = random_attention(cfg_of())
    before = attn.projections().map(lambda t: t.detach().clone())
    new_k = torch.full((32, 32), 0.5, dtype=F64)
    attn.load_projections(Projections(w_k=new_k, b_v=torch.zeros(32, dtype=F64)))
    after = attn.projections()
    assert torch.equal(after.w_k, new_k) and not bool(after.b_v.any())
    for name in ("w_q", "w_v", "b_q", "b_k"):
        assert torch.equal(getattr(after, name), getattr(before, name))


def test_writers_refuse_parts_the_attention_lacks_or_misshapen_ones():
    attn = Attention(cfg_of(projection="q-identity", bias=False))
    with pytest.raises(QkvlabError, match="w_q given, but this attention has none"):
        attn.load_projections(Projections(w_q=torch.zeros(32, 32)))
    with pytest.raises(QkvlabError, match="b_k given"):
        attn.load_projections(Projections(b_k=torch.zeros(32)))
    with pytest.raises(QkvlabError, match=r"w_k must be \(32, 32\), got \(32, 16\)"):
        attn.load_projections(Projections(w_k=torch.zeros(32, 16)))
    layout = attn.layout
    k = torch.zeros(32, 32)
    with pytest.raises(QkvlabError, match="has no W_Q"):
        layout.fuse(Projections(w_q=k, w_k=k, w_v=k))
    with pytest.raises(QkvlabError, match="holds W_V"):
        layout.fuse(Projections(w_k=k))
    with pytest.raises(QkvlabError, match=r"W_V must be \(32, 32\)"):
        layout.fuse(Projections(w_k=k, w_v=torch.zeros(16, 32)))
    with pytest.raises(QkvlabError, match="fused in_proj of this layout"):
        layout.split(torch.zeros(96, 32))


def _output_before_out_proj(attn: Attention, x, rope) -> torch.Tensor:
    seen = []
    hook = attn.out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            attn(x, rope)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kw", SCHEMES, ids=str)
def test_probabilities_times_values_is_the_attention_output(kw, attn_impl):
    cfg = cfg_of(**kw, attn_impl=attn_impl)
    attn = random_attention(cfg)
    x, rope = inputs(cfg), rope_for(cfg)
    B, T, _ = x.shape
    with torch.no_grad():
        p = attn.probabilities(x, rope)
        _, _, v = attn.heads(x, rope)
    assert p.shape == (B, cfg.n_head, T, T)
    torch.testing.assert_close(p.sum(-1), torch.ones(B, cfg.n_head, T, dtype=F64))
    v = v.repeat_interleave(cfg.n_head // cfg.kv_heads, dim=1)  # query head h reads h // group
    y = (p @ v).transpose(1, 2).reshape(B, T, cfg.n_head * cfg.d_head)
    torch.testing.assert_close(y, _output_before_out_proj(attn, x, rope), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_scores_mask_exactly_the_pairs_forward_cannot_see(causal):
    cfg = cfg_of(causal=causal, attn_scale="learned")
    attn = random_attention(cfg)
    x = inputs(cfg)
    with torch.no_grad():
        masked, raw = attn.scores(x), attn.scores(x, masked=False)
    allowed = attn.allowed(x.shape[1])
    assert torch.equal(allowed, torch.ones(9, 9, dtype=torch.bool).tril() if causal
                       else torch.ones(9, 9, dtype=torch.bool))
    assert bool(torch.isfinite(raw).all())
    assert bool((masked[..., ~allowed] == float("-inf")).all())
    assert torch.equal(masked[..., allowed], raw[..., allowed])


def test_scores_carry_the_scale_and_the_learned_gain():
    cfg = cfg_of(attn_scale="learned")
    attn = random_attention(cfg)
    x = inputs(cfg)
    with torch.no_grad():
        raw = attn.scores(x, masked=False)
        attn.logit_gain.mul_(2.0)
        doubled = attn.scores(x, masked=False)
    torch.testing.assert_close(doubled, 2 * raw)
    w_q, w_k = attn.projections().w_q, attn.projections().w_k
    b_q, b_k = attn.projections().b_q, attn.projections().b_k
    q = (x @ w_q.T + b_q).view(2, 9, 4, 8).transpose(1, 2) * attn.logit_gain.view(1, -1, 1, 1)
    k = (x @ w_k.T + b_k).view(2, 9, 4, 8).transpose(1, 2)
    torch.testing.assert_close(doubled, q @ k.transpose(-2, -1) * cfg.scale)


def _gpt(cfg: ModelConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("fmt", ["gpt2", "llama"])
@pytest.mark.parametrize("projection", ["baseline", "q-identity", "k-identity", "v-identity"])
def test_hf_round_trips_give_back_the_same_projections(projection, fmt):
    """Export and import write and read in_proj through the layout: what comes back is the
    same W_Q, W_K, W_V (Llama reads W_V = I back as the matrix I: it detects Q and K only)."""
    cfg = cfg_of(n_layer=2, projection=projection)
    if fmt == "llama":
        cfg = dataclasses.replace(cfg, norm="rmsnorm", positions="rope", mlp="swiglu",
                                  bias=False)
    model = _gpt(cfg, 3)
    back = from_gpt2(*to_gpt2(model))[0] if fmt == "gpt2" else from_llama(*to_llama(model))
    v_matrix = fmt == "llama" and projection == "v-identity"
    assert back.cfg.projection == ("baseline" if v_matrix else projection)
    for a, b in zip(model.blocks, back.blocks, strict=True):
        pa, pb = a.attn.projections(), b.attn.projections()
        for n in "qkv":
            if pa.weight(n) is None:
                assert pb.weight(n) is None or (v_matrix and torch.equal(pb.w_v, torch.eye(32)))
                continue
            torch.testing.assert_close(pb.weight(n), pa.weight(n), rtol=1e-6, atol=0)
            if cfg.bias:
                torch.testing.assert_close(pb.bias(n), pa.bias(n), rtol=1e-6, atol=0)
