"""The model family: attention schemes against an einsum reference, causality, KV cache,
parameter accounting, config validation."""

import dataclasses
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkvlab.errors import QkvlabError
from qkvlab.model import GPT, PROJECTIONS, ModelConfig
from qkvlab.model.attention_kernels import causal_block_rows, eager_attention
from qkvlab.model.generate import generate, sample_next
from qkvlab.model.gpt import Attention
from qkvlab.model.params import count_params, flops_per_token

PAPER = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
# docs/paper.md section 5: baseline, reduced, reduced+4.5d MLP, 3.5d MLP control, d=744 control
PAPER_VARIANTS = [
    (dict(), 84_953_856, 124_373_760),
    (dict(projection="q-identity"), 77_875_968, 117_295_872),
    (dict(projection="q-identity", mlp_ratio=4.5), 84_953_856, 124_373_760),
    (dict(mlp_ratio=3.5), 77_875_968, 117_295_872),
    (dict(n_embd=744), 79_727_784, 117_915_816),
]


def tiny(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=50)
    base.update(kw)
    return ModelConfig(**base)


def reference_attention(attn: Attention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention written out with einsum, independent of the module's SDPA path."""
    cfg = attn.cfg
    B, T, d = x.shape
    H, Hkv, dk = cfg.n_head, cfg.kv_heads, cfg.d_head
    w = attn.in_proj.weight
    nq, nk, nv = attn.sizes
    wq, wk, wv = w[:nq], w[nq:nq + nk], w[nq + nk:]
    ident = torch.eye(d, dtype=x.dtype)
    if cfg.projection == "q-identity":
        wq = ident
    if cfg.projection == "k-identity":
        wk = ident
    if cfg.projection == "v-identity":
        wv = ident
    q = x @ wq.T if cfg.projection != "nonlinear-q" else 0.5 * (x + attn.query_map(x))
    k, v = x @ wk.T, x @ wv.T
    q = q.reshape(B, T, H, dk)
    k = k.reshape(B, T, Hkv, dk).repeat_interleave(H // Hkv, dim=2)
    v = v.reshape(B, T, Hkv, dk).repeat_interleave(H // Hkv, dim=2)
    logits = cfg.scale * torch.einsum("bthe,bshe->bhts", q, k)
    if causal:
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhts,bshe->bthe", logits.softmax(-1), v).reshape(B, T, H * dk)
    return y @ attn.out_proj.weight.T


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_attention_matches_einsum_reference(projection, causal, n_kv_head, attn_impl):
    if projection in ("k-identity", "v-identity") and n_kv_head != 4:
        pytest.skip("key/value identity needs n_kv_head == n_head")
    torch.manual_seed(0)
    cfg = tiny(projection=projection, causal=causal, n_kv_head=n_kv_head, attn_impl=attn_impl)
    attn = Attention(cfg).double()
    for p in attn.parameters():  # move off the tiny init so differences would show
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(3, 11, cfg.n_embd, dtype=torch.float64)
    expected = reference_attention(attn, x, causal)
    torch.testing.assert_close(attn(x), expected, atol=1e-10, rtol=1e-10)


def test_identity_query_uses_no_query_weights():
    base, red = tiny(), tiny(projection="q-identity")
    assert Attention(base).in_proj.out_features == 3 * 32
    assert Attention(red).in_proj.out_features == 2 * 32
    assert Attention(tiny(projection="nonlinear-q")).in_proj.out_features == 2 * 32


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_causality_later_tokens_never_change_earlier_logits(projection, positions):
    torch.manual_seed(1)
    model = GPT(tiny(projection=projection, positions=positions)).eval()
    idx = torch.randint(0, 50, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = torch.randint(0, 50, (2, 5))
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_encoder_is_bidirectional():
    torch.manual_seed(1)
    model = GPT(tiny(causal=False)).eval()
    idx = torch.randint(0, 50, (1, 10))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 50
    assert not torch.allclose(model(idx)[0][:, 0], model(changed)[0][:, 0])


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_kv_cache_logits_equal_full_forward(projection, positions, attn_impl):
    torch.manual_seed(2)
    cfg = tiny(projection=projection, positions=positions, attn_impl=attn_impl,
               n_kv_head=4 if "k" in projection or "v" in projection else 2)
    model = GPT(cfg).double().eval()
    idx = torch.randint(0, 50, (2, 14))
    full, _ = model(idx)
    cache = model.new_cache(2)
    # prefill 5, then a chunk of 4 (exercises the offset causal mask), then single tokens
    pieces = [(0, 5), (5, 9)] + [(t, t + 1) for t in range(9, 14)]
    outs = [model(idx[:, a:b], cache=cache, start_pos=a)[0] for a, b in pieces]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-10, rtol=1e-10)


def test_generate_with_cache_equals_without_and_respects_seed():
    torch.manual_seed(3)
    model = GPT(tiny(projection="q-identity", block_size=16))
    prompt = torch.randint(0, 50, (2, 3))
    # 20 new tokens overflow block_size 16: exercises the sliding window too
    kw = dict(max_new_tokens=20, temperature=0.9, top_k=20, top_p=0.95, seed=7)
    a = generate(model, prompt, use_cache=True, **kw)
    b = generate(model, prompt, use_cache=False, **kw)
    assert a.shape == (2, 23)
    assert torch.equal(a, b)
    assert torch.equal(a, generate(model, prompt, use_cache=True, **kw))


def test_bf16_weights_on_cpu_get_an_fp32_cache_that_matches_the_full_forward():
    torch.manual_seed(6)
    model = GPT(tiny(projection="q-identity")).to(torch.bfloat16).eval()
    cache = model.new_cache(2)
    assert cache.k[0].dtype == torch.float32 and cache.bytes_per_token() == 2 * 2 * 4 * 8 * 4
    assert model.new_cache(2, dtype=torch.bfloat16).k[0].dtype == torch.bfloat16
    assert GPT(tiny()).new_cache(1).k[0].dtype == torch.float32
    idx = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full, _ = model(idx)
        outs = [model(idx[:, :6], cache=cache)[0]]
        outs += [model(idx[:, t:t + 1], cache=cache, start_pos=t)[0] for t in range(6, 12)]
    step = torch.cat(outs, dim=1)
    assert step.dtype == torch.bfloat16  # the wider cache does not leak into the activations
    torch.testing.assert_close(step.float(), full.float(), atol=0.05, rtol=0.05)


@pytest.mark.slow
def test_compiled_generate_equals_eager_and_is_built_once_per_weights():
    from qkvlab.model.generate import compiled_forward

    torch.manual_seed(8)
    model = GPT(tiny(projection="q-identity", block_size=16))
    prompt = torch.randint(0, 50, (2, 3))
    eager = generate(model, prompt, 6, temperature=0)
    assert torch.equal(generate(model, prompt, 6, temperature=0, compile=True), eager)
    before = compiled_forward(model)
    assert compiled_forward(model) is before  # reused, not recompiled
    with torch.no_grad():  # frozen weights must not outlive a change to the weights
        model.lm_head.weight.mul_(-1.0)
        after = compiled_forward(model)
        assert after is not before
        torch.testing.assert_close(after(prompt)[0], model(prompt)[0])


def test_generate_stops_at_stop_token():
    torch.manual_seed(4)
    model = GPT(tiny())
    prompt = torch.zeros(1, 2, dtype=torch.long)
    free = generate(model, prompt, 10, temperature=0)
    stop = free[0, 4].item()  # the third greedy token
    first = (free[0, 2:] == stop).nonzero()[0].item()
    out = generate(model, prompt, 10, temperature=0, stop_token=stop)
    assert out.shape[1] == 2 + first + 1
    assert torch.equal(out, free[:, : out.shape[1]])


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {2, 3}
    draws = {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(200)}
    assert draws == {3}  # p(3) = 0.64 already covers half the mass
    assert sample_next(logits, 0.0).item() == 3


@pytest.mark.parametrize("variant,non_embedding,total", PAPER_VARIANTS)
def test_paper_parameter_counts(variant, non_embedding, total):
    cfg = ModelConfig(**{**PAPER, **variant})
    counts = count_params(cfg)
    assert counts.non_embedding == non_embedding
    assert counts.total == total
    untied = count_params(dataclasses.replace(cfg, tie_embeddings=False))
    assert untied.total == total + 50304 * cfg.n_embd
    assert untied.non_embedding == non_embedding


def test_paper_counts_match_instantiated_model():
    for variant, _, total in PAPER_VARIANTS:
        with torch.device("meta"):
            model = GPT(ModelConfig(**{**PAPER, **variant}))
        assert sum(p.numel() for p in model.parameters()) == total


def test_mlp_ratio_gives_paper_hidden_width():
    assert ModelConfig(**PAPER, mlp_ratio=4.5).hidden == 3456
    assert ModelConfig(**PAPER, mlp_hidden=1000).hidden == 1000


@settings(max_examples=40, deadline=None)
@given(
    n_layer=st.integers(1, 3),
    n_head=st.sampled_from([1, 2, 4]),
    kv_div=st.sampled_from([1, 2]),
    d_mult=st.integers(1, 4),
    projection=st.sampled_from(PROJECTIONS),
    norm=st.sampled_from(["layernorm", "rmsnorm", "none"]),
    positions=st.sampled_from(["learned", "rope", "none"]),
    bias=st.booleans(),
    tie=st.booleans(),
    share=st.booleans(),
    mlp_ratio=st.sampled_from([1.0, 3.5, 4.0, 4.5]),
)
def test_counts_equal_numel_for_any_config(n_layer, n_head, kv_div, d_mult, projection, norm,
                                           positions, bias, tie, share, mlp_ratio):
    kv = n_head // kv_div if projection not in ("k-identity", "v-identity") else n_head
    cfg = ModelConfig(n_layer=n_layer, n_head=n_head, n_kv_head=max(kv, 1),
                      n_embd=8 * n_head * d_mult, block_size=8, vocab_size=17,
                      projection=projection, norm=norm, positions=positions, bias=bias,
                      tie_embeddings=tie, share_layers=share, mlp_ratio=mlp_ratio)
    with torch.device("meta"):
        model = GPT(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_attention_scale_defaults_and_override():
    # the default is the standard 1/sqrt(d_k) for every scheme; "paper" halves an identity's
    for projection in ("baseline", "q-identity", "k-identity", "v-identity", "nonlinear-q"):
        assert tiny(projection=projection).scale == pytest.approx(1 / math.sqrt(8))
    assert tiny(projection="q-identity", attn_scale="paper").scale == \
        pytest.approx(1 / (2 * math.sqrt(8)))
    assert tiny(projection="k-identity", attn_scale="paper").scale == \
        pytest.approx(1 / (2 * math.sqrt(8)))
    assert tiny(projection="v-identity", attn_scale="paper").scale == \
        pytest.approx(1 / math.sqrt(8))
    assert tiny(projection="q-identity", attn_scale=0.3).scale == 0.3


def test_flops_ratio_matches_the_documented_figures():
    baby = ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65)
    paper = ModelConfig(**PAPER)
    for cfg, ideal in ((baby, 1.08), (paper, 1.05)):
        red = dataclasses.replace(cfg, projection="q-identity")
        assert flops_per_token(cfg) / flops_per_token(red) == pytest.approx(ideal, abs=0.005)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(projection="q-identity", head_dim=4), "n_head * head_dim == n_embd"),
        (dict(projection="k-identity", n_kv_head=2), "n_kv_head == n_head"),
        (dict(n_kv_head=3), "divisible by n_kv_head"),
        (dict(n_embd=30), "divisible by n_head"),
        (dict(projection="w-identity"), "projection='w-identity' is not one of"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(dropout=1.5), "dropout"),
        (dict(norm="batchnorm"), "norm='batchnorm'"),
    ],
)
def test_invalid_configs_fail_with_the_rule(kwargs, fragment):
    with pytest.raises(QkvlabError, match="invalid model config") as err:
        tiny(**kwargs)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_from_dict_rejects_unknown_and_mistyped_keys():
    with pytest.raises(QkvlabError, match="unknown key.*n_layers.*valid keys"):
        ModelConfig.from_dict({"n_layers": 3})
    with pytest.raises(QkvlabError, match="model.n_layer must be int"):
        ModelConfig.from_dict({"n_layer": "3"})
    with pytest.raises(QkvlabError, match="model.bias must be bool"):
        ModelConfig.from_dict({"bias": 1})
    cfg = ModelConfig.from_dict({"n_layer": 3, "mlp_ratio": 4})
    assert cfg.n_layer == 3 and cfg.mlp_ratio == 4.0


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_bf16_autocast_forward_and_backward(projection):
    torch.manual_seed(5)
    model = GPT(tiny(projection=projection))
    idx = torch.randint(0, 50, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mask", [None, "causal", "bool", "float", "per-batch"])
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_eager_attention_equals_sdpa(mask, n_kv_head):
    """eager_attention takes SDPA's arguments with SDPA's meaning (float64: exact to rounding),
    queries fewer than keys included (a KV-cache chunk)."""
    torch.manual_seed(7)
    n_q, n_k = (7, 7) if mask == "causal" else (3, 7)
    q = torch.randn(2, 4, n_q, 8, dtype=torch.float64)
    k, v = (torch.randn(2, n_kv_head, n_k, 8, dtype=torch.float64) for _ in range(2))
    attn_mask = {None: None, "causal": None,
                 "bool": torch.arange(4, 7)[:, None] >= torch.arange(7)[None, :],
                 "float": torch.randn(n_q, n_k, dtype=torch.float64),
                 "per-batch": torch.randn(2, 1, n_q, n_k, dtype=torch.float64)}[mask]
    kw = dict(attn_mask=attn_mask, is_causal=mask == "causal", scale=0.3,
              enable_gqa=n_kv_head != 4)
    torch.testing.assert_close(eager_attention(q, k, v, **kw),
                               F.scaled_dot_product_attention(q, k, v, **kw),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("n_q", "n_k", "block"), [(7, 7, 3), (7, 7, 1), (4, 9, 2), (9, 4, 4)])
def test_blocked_causal_eager_attention_equals_sdpa(n_q, n_k, block):
    """The causal path skips the masked blocks right of the diagonal: the output and every
    gradient still equal SDPA's (float64), for ragged last blocks and for more keys than
    queries or more queries than keys (SDPA's top-left triangle)."""
    torch.manual_seed(8)
    q = torch.randn(2, 3, n_q, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, n_k, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(2, 3, n_q, 8, dtype=torch.float64)  # a loss that weighs every output
    grads = []
    for attend in (partial(eager_attention, causal_block=block), F.scaled_dot_product_attention):
        y = attend(q, k, v, is_causal=True, scale=0.4)
        grads.append((y, *torch.autograd.grad((y * w).sum(), (q, k, v))))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_causal_block_rows():
    assert [causal_block_rows(t) for t in (32, 256, 512, 1024, 1025)] == [256, 256, 256, 256, 257]


@pytest.mark.parametrize("causal", [True, False])
def test_eager_attention_trains_like_sdpa_under_bf16(causal):
    """Same weights, bf16 autocast: the eager path's bf16 scores stay within bf16 noise of
    SDPA's fp32 ones, in the loss and in every gradient."""
    torch.manual_seed(6)
    models = {impl: GPT(tiny(causal=causal, attn_impl=impl)) for impl in ("sdpa", "eager")}
    models["eager"].load_state_dict(models["sdpa"].state_dict())
    idx = torch.randint(0, 50, (4, 16))
    losses = {}
    for impl, model in models.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, losses[impl] = model(idx, idx)
        losses[impl].backward()
    assert abs(losses["eager"].item() - losses["sdpa"].item()) < 2e-3
    for (name, a), b in zip(models["sdpa"].named_parameters(), models["eager"].parameters(),
                            strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=2e-3, rtol=5e-2, msg=name)
    with pytest.raises(QkvlabError, match="attn_impl='flash' is not one of auto, sdpa, eager"):
        tiny(attn_impl="flash")


@pytest.mark.parametrize("norm", ["layernorm", "none"])
def test_shared_layers_and_residual_layouts(norm):
    """Each residual layout is its formula, written here from the block's own modules (a = the
    attention of norm1 x): "full" x + a + MLP(norm2(x + a)), "attention" MLP(norm2(x + a)),
    "none" MLP(norm2 a); the three differ; a shared block is applied n_layer times."""
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for residual in ("full", "attention", "none"):
        torch.manual_seed(2)  # the same weights for every layout
        model = GPT(tiny(residual=residual, share_layers=True, norm=norm)).eval()
        assert len(model.blocks) == 1
        block = model.blocks[0]
        with torch.no_grad():
            a = block.attn(block.norm1(x))
            want = {"full": x + a + block.mlp(block.norm2(x + a)),
                    "attention": block.mlp(block.norm2(x + a)),
                    "none": block.mlp(block.norm2(a))}[residual]
            outputs[residual] = block(x)
            torch.testing.assert_close(outputs[residual], want)
            h = model.wte(idx) + model.wpe(torch.arange(8))
            for _ in range(model.cfg.n_layer):
                h = block(h)
            torch.testing.assert_close(model.hidden_states(idx), model.norm_f(h))
    for one, other in (("full", "attention"), ("full", "none"), ("attention", "none")):
        assert not torch.allclose(outputs[one], outputs[other], atol=1e-3), (one, other)
