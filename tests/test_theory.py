"""Theory toolkit: exact conversions (docs/paper.md sections 1-2) and their refusals.

Property-based: random shapes (d, H, L, m), layouts and seeds. Every exact conversion must match
to float64 rounding error; every obstruction must miss by far more.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkvlab.errors import QkvlabError
from qkvlab.model.attention_layout import Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.model.params import count_params
from qkvlab.theory import approximate_convert, convert
from qkvlab.theory.common import (
    float64_logits,
    max_logit_diff,
    param_count,
    random_model,
    random_orthogonal,
    random_tokens,
)
from qkvlab.theory.lemma import identity_error, invariance_error
from qkvlab.theory.limits import conversion_error, set_projection_, small_config

PROPS = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OBSTRUCTION = 1e-6  # obstructions must miss by at least this (exact cases reach ~1e-13)


def exact_tol(model: GPT, idx: torch.Tensor) -> float:
    """Float64 rounding budget: relative to the size of the logits."""
    return 1e-10 * max(1.0, float(float64_logits(model, idx).abs().max()))


@st.composite
def layouts(draw, norm: str = "none") -> dict:
    n_head = draw(st.sampled_from([1, 2, 4]))
    d_head = draw(st.sampled_from([2, 3, 4]))
    to = draw(st.sampled_from(["q-identity", "k-identity", "v-identity"]))
    positions = draw(st.sampled_from(["learned", "rope", "none"]))
    if positions == "rope" and d_head % 2:
        positions = "learned"
    kv = None
    if to == "q-identity" and n_head > 1 and draw(st.booleans()):
        kv = draw(st.sampled_from([k for k in (1, 2) if n_head % k == 0]))
    return dict(
        n_layer=draw(st.integers(1, 3)),
        n_head=n_head,
        n_embd=n_head * d_head,
        n_kv_head=kv,
        mlp_hidden=draw(st.integers(1, 24)),
        block_size=draw(st.integers(1, 8)),
        vocab_size=draw(st.integers(2, 20)),
        residual=draw(st.sampled_from(["none", "attention", "full"])),
        share_layers=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        positions=positions,
        bias=draw(st.booleans()),
        causal=draw(st.booleans()),
        norm=norm,
        to=to,
        seed=draw(st.integers(0, 2**16)),
    )


def build(layout: dict) -> tuple[GPT, str, int]:
    layout = dict(layout)
    to, seed = layout.pop("to"), layout.pop("seed")
    model = random_model(ModelConfig(**layout), seed)
    which = to[0]
    for blk in model.blocks:
        parts = blk.attn.projections()
        if model.cfg.bias and which == "q":  # an identity query has no bias (refusal test)
            blk.attn.load_projections(Projections(b_q=torch.zeros_like(parts.b_q)))
        if model.cfg.bias and which == "k" and model.cfg.positions == "rope":
            blk.attn.load_projections(Projections(b_k=torch.zeros_like(parts.b_k)))
    return model, to, seed


def free_end(cfg: ModelConfig) -> bool:
    """The last W_2 writes the stream without a skip, so it can carry any basis."""
    return cfg.residual != "full" and not (cfg.share_layers and cfg.n_layer > 1)


def in_theorem(cfg: ModelConfig) -> bool:
    return not (cfg.residual == "full" and not cfg.share_layers and cfg.n_layer > 1)


# ---- section 1 ------------------------------------------------------------------------------

@PROPS
@given(n_head=st.sampled_from([1, 2, 4]), d_head=st.integers(1, 4), causal=st.booleans(),
       gqa=st.booleans(), seed=st.integers(0, 2**16))
def test_invariance_lemma(n_head, d_head, causal, gqa, seed):
    kv = 1 if gqa and n_head > 1 else None
    assert invariance_error(n_head * d_head, n_head, n_kv_head=kv, causal=causal, seed=seed) \
        < 1e-10


@PROPS
@given(which=st.sampled_from("qkv"), n_head=st.sampled_from([1, 2, 4]), d_head=st.integers(1, 4),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_identity_reparametrisation(which, n_head, d_head, causal, seed):
    assert identity_error(which, n_head * d_head, n_head, causal=causal, seed=seed) < 1e-10


def test_lemma_rejects_a_wrong_shape():
    with pytest.raises(QkvlabError, match="T must be 16 x 16"):
        invariance_error(16, 4, T=torch.eye(8, dtype=torch.float64))


# ---- section 2: exact conversions --------------------------------------------------------------

@PROPS
@given(layout=layouts())
def test_exact_conversions_match_in_float64(layout):
    model, to, seed = build(layout)
    cfg = model.cfg
    if not in_theorem(cfg):
        return  # covered by test_full_skips_without_sharing_is_an_obstruction
    if cfg.tie_embeddings and not free_end(cfg):
        # section 2.4: exact only for an orthogonal basis; use one (the generic case is below)
        set_projection_(model, to[0], [random_orthogonal(cfg.n_embd, seed + i)
                                       for i in range(len(model.blocks))])
    new, report = convert(model, to)
    idx = random_tokens(cfg, seed)
    assert max_logit_diff(model, new, idx) <= exact_tol(model, idx), report.summary()
    # a regular model of the family, same scale, d^2 (+ d with biases) fewer per block
    assert new.cfg.projection == to and new.cfg.attn_scale == pytest.approx(cfg.scale)
    assert new.cfg == dataclasses.replace(cfg, projection=to, attn_scale=cfg.scale)
    per_block = cfg.n_embd ** 2 + (cfg.n_embd if cfg.bias else 0)
    assert report.params_saved == len(model.blocks) * per_block
    assert param_count(new) == count_params(new.cfg).total
    assert report.exact and not report.violations


@PROPS
@given(layout=layouts(), n_layer=st.integers(2, 3))
def test_full_skips_without_sharing_is_an_obstruction(layout, n_layer):
    layout.update(residual="full", share_layers=False, n_layer=n_layer)
    model, to, seed = build(layout)
    with pytest.raises(QkvlabError, match="section 2.3"):
        convert(model, to)
    new, report = approximate_convert(model, to)
    assert not report.exact
    idx = random_tokens(model.cfg, seed, batch=4)
    assert max_logit_diff(model, new, idx) > OBSTRUCTION


@PROPS
@given(layout=layouts(), n_layer=st.integers(1, 3))
def test_tied_head_on_a_residual_path_needs_orthogonal_t(layout, n_layer):
    layout.update(residual="full", share_layers=True, tie_embeddings=True, n_layer=n_layer,
                  n_embd=max(layout["n_embd"], 2 * layout["n_head"]))
    model, to, seed = build(layout)
    with pytest.raises(QkvlabError, match="section 2.4"):
        convert(model, to)
    new, _ = approximate_convert(model, to)
    idx = random_tokens(model.cfg, seed, batch=4)
    assert max_logit_diff(model, new, idx) > OBSTRUCTION


def test_layer_bases_are_carried_by_w2():
    """Section 2.2 spelled out on one model: W_O' = W_O T_l, W_1' = T_l^-1 W_1, W_2' = W_2
    T_{l+1}, T_{L+1} = I, embeddings times T_1."""
    model = random_model(small_config(n_layer=2, residual="attention"), 3)
    new, _ = convert(model)
    W = [b.attn.projections().w_q.detach().T for b in model.blocks]  # paper W_Q per layer
    n0, n1 = new.blocks
    o0, o1 = model.blocks
    torch.testing.assert_close(new.wte.weight, model.wte.weight @ W[0])
    torch.testing.assert_close(n0.attn.out_proj.weight.T, o0.attn.out_proj.weight.T @ W[0])
    torch.testing.assert_close(n0.mlp.fc_in.weight.T, torch.linalg.solve(W[0],
                                                                         o0.mlp.fc_in.weight.T))
    torch.testing.assert_close(n0.mlp.fc_out.weight.T, o0.mlp.fc_out.weight.T @ W[1])
    torch.testing.assert_close(n1.mlp.fc_out.weight, o1.mlp.fc_out.weight)  # T_3 = I
    kept = n0.attn.projections()  # only K and V rows remain
    assert kept.w_q is None and kept.w_k.shape == kept.w_v.shape == (16, 16)
    assert n0.attn.in_proj.weight.shape == (32, 16)


def test_conversion_keeps_dtype_and_returns_a_new_model():
    torch.manual_seed(0)
    model = GPT(small_config(n_layer=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new, _ = convert(model)
    assert new is not model and next(new.parameters()).dtype == torch.float32
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    new64, _ = convert(model, dtype=torch.float64)
    assert next(new64.parameters()).dtype == torch.float64


def test_biases_are_handled_exactly_or_refused():
    cfg = small_config(n_layer=2, residual="attention", bias=True)
    model = random_model(cfg, 5)
    with pytest.raises(QkvlabError, match="nonzero query bias b_Q"):
        convert(model, "q-identity")
    for to in ("k-identity", "v-identity"):  # b_K dropped (softmax shift), b_V folded into b_O
        assert conversion_error(model, to, exact=True).error < 1e-10
    rope = random_model(dataclasses.replace(cfg, positions="rope"), 5)
    with pytest.raises(QkvlabError, match="key bias b_K under RoPE"):
        convert(rope, "k-identity")


# ---- refusals ----------------------------------------------------------------------------------

def _refusal(model: GPT, to: str, pattern: str) -> str:
    with pytest.raises(QkvlabError, match=pattern) as info:
        convert(model, to)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_refuses_gqa_for_key_and_value():
    model = random_model(small_config(n_kv_head=2), 0)
    for to in ("k-identity", "v-identity"):
        _refusal(model, to, "grouped-query attention")
    assert conversion_error(model, "q-identity", exact=True).error < 1e-10


def test_refuses_singular_and_ill_conditioned_projections():
    model = random_model(small_config(), 0)
    attn = model.blocks[1].attn
    w = attn.projections().w_q.detach().clone()
    w[3] = 0.0  # a zero row of W_Q^T: singular
    attn.load_projections(Projections(w_q=w))
    _refusal(model, "q-identity", r"layer 1's W_Q is singular")
    u, _, vh = torch.linalg.svd(torch.randn(16, 16, dtype=torch.float64))
    s = torch.logspace(0, -10, 16, dtype=torch.float64)
    attn.load_projections(Projections(w_q=u @ torch.diag(s) @ vh))
    msg = _refusal(model, "q-identity", r"ill-conditioned \(condition number 1(\.\d+)?e\+10")
    assert "limit 1e+08" in msg
    convert(model, "q-identity", cond_limit=1e12)  # the caller may accept it knowingly


def test_refuses_layouts_outside_the_theorems():
    base = small_config()
    cases = [
        (dict(norm="layernorm", residual="full"), "section 3: normalization obstructs"),
        (dict(norm="rmsnorm"), "section 3: normalization obstructs"),
        (dict(residual="full", n_layer=3), "section 2.3: full skips"),
        (dict(residual="full", share_layers=True, tie_embeddings=True), "section 2.4"),
        (dict(projection="nonlinear-q"), "projection=nonlinear-q"),
        (dict(projection="q-identity"), "projection=q-identity"),
        (dict(n_head=4, head_dim=3), "square, invertible W_Q"),
    ]
    for overrides, pattern in cases:
        model = random_model(dataclasses.replace(base, **overrides), 1)
        _refusal(model, "q-identity", pattern)
    with pytest.raises(QkvlabError, match="choose one of"):
        convert(random_model(base, 0), "w-identity")
    bad = random_model(base, 0)
    with torch.no_grad():
        bad.wte.weight[0, 0] = float("nan")
    _refusal(bad, "q-identity", "non-finite weights")


def test_converted_model_trains_samples_and_saves(tmp_path):
    from qkvlab.model.generate import generate
    from qkvlab.run.checkpoint import write_checkpoint
    from qkvlab.run.config import RunConfig
    from qkvlab.run.load import load_model

    torch.manual_seed(0)
    model = GPT(small_config(n_layer=2, tie_embeddings=True))
    new, _ = convert(model)
    idx = torch.randint(32, (4, 12))
    opt = torch.optim.AdamW(new.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):  # overfit one batch
        _, loss = new(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    out = generate(new.eval(), idx[:1, :3], 5, temperature=0.0)
    assert out.shape == (1, 8)
    write_checkpoint(tmp_path / "ck", new.state_dict(), RunConfig(model=new.cfg),
                     state={"step": 0})
    loaded, _ = load_model(tmp_path / "ck")
    assert loaded.cfg == new.cfg
    assert max_logit_diff(loaded, new, idx) == 0.0
