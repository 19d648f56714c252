"""`qkvlab.hf.identity_query`: W_Q = I inside transformers' Llama and GPT-2 models."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from qkvlab.errors import QkvlabError  # noqa: E402
from qkvlab.hf.gpt2 import from_gpt2  # noqa: E402
from qkvlab.hf.identity_query import identity_query  # noqa: E402
from qkvlab.hf.llama import from_llama  # noqa: E402
from qkvlab.model.scale import attention_scale  # noqa: E402

V, D, L, H, KV, T = 64, 32, 2, 4, 2, 16


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=L,
               num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=32,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **kw})).eval()


def gpt2(**kw) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=32, bos_token_id=0,
               eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **kw})).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def test_parameter_count_drops_by_the_query_weights_llama():
    for bias in (False, True):
        model = llama(attention_bias=bias)
        before = model.num_parameters()
        report = identity_query(model, scale="paper")
        removed = L * (D * D + (D if bias else 0))  # by hand: one d x d W_Q (+ b_Q) a layer
        assert before - model.num_parameters() == removed == report.parameters_removed
        assert not any("q_proj" in n for n, _ in model.named_parameters())


def test_parameter_count_drops_by_the_query_columns_gpt2():
    model = gpt2()
    before = model.num_parameters()
    identity_query(model, scale="paper")
    assert before - model.num_parameters() == L * (D * D + D)  # c_attn's q columns and bias
    c_attn = model.transformer.h[0].attn.c_attn
    assert tuple(c_attn.weight.shape) == (D, 2 * D)  # only K and V are left


def test_learned_gain_adds_one_parameter_per_head_and_no_decay_under_trainer():
    model = llama()
    before = model.num_parameters()
    report = identity_query(model, scale="learned")
    assert report.learned_gain
    assert before - model.num_parameters() == L * (D * D - H)
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    decay = Trainer(model=model, args=args).get_decay_parameter_names(model)
    gains = [n for n, _ in model.named_parameters() if "gain" in n]
    assert len(gains) == L and not set(gains) & set(decay)
    assert "model.layers.0.self_attn.k_proj.weight" in decay


@pytest.mark.parametrize("setting", ["paper", "standard", "matched", "fitted", 0.3])
def test_the_scale_follows_qkvlab_rules(setting):
    model = llama()
    report = identity_query(model, scale=setting)
    d_head = D // H
    expected = attention_scale(setting, "q-identity", D, d_head, model.config.initializer_range)
    assert report.scale == pytest.approx(expected, rel=1e-12)
    q = model.model.layers[0].self_attn.q_proj
    assert q.ratio == pytest.approx(expected * math.sqrt(d_head), rel=1e-12)


def test_gpt2_without_scale_attn_weights_folds_the_whole_scale():
    model = gpt2(scale_attn_weights=False)  # transformers' logit scale is 1 here
    report = identity_query(model, scale="paper")
    assert report.ratios[0] == pytest.approx(0.5 / math.sqrt(D // H))


@pytest.mark.parametrize("build,convert", [(llama, "llama"), (gpt2, "gpt2")])
@pytest.mark.parametrize("setting", ["paper", "learned"])
def test_logits_equal_qkvlab_gpt_with_the_same_weights(build, convert, setting):
    model = build()
    identity_query(model, scale=setting)
    if setting == "learned":  # gains away from 1, so a dropped gain would show
        for n, p in model.named_parameters():
            if "gain" in n:
                p.data.uniform_(0.5, 1.5)
    config = model.config.to_dict()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ours = from_llama(config, state) if convert == "llama" else from_gpt2(config, state)[0]
    # qkvlab's importer reads a common r I back as W_Q = I; per-head gains stay a diagonal W_Q
    assert ours.cfg.projection == ("q-identity" if setting == "paper" else "baseline")
    x = tokens()
    with torch.no_grad():
        expected = ours(x)[0] if isinstance(ours(x), tuple) else ours(x)
    torch.testing.assert_close(logits(model, x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", [llama, gpt2])
@pytest.mark.parametrize("setting", ["paper", "learned"])
def test_save_pretrained_loads_unpatched_then_patches_back(build, setting, tmp_path):
    model = build()
    identity_query(model, scale=setting)
    for n, p in model.named_parameters():
        if "gain" in n:
            p.data.uniform_(0.5, 1.5)
    x = tokens()
    before = logits(model, x)
    model.save_pretrained(tmp_path)
    plain = type(model).from_pretrained(tmp_path).eval()  # unpatched transformers
    torch.testing.assert_close(logits(plain, x), before, rtol=0, atol=1e-6)
    n_plain = plain.num_parameters()
    report = identity_query(plain)  # recognises r I and removes it again
    assert report.how.startswith("kept") and report.learned_gain == (setting == "learned")
    assert plain.num_parameters() == model.num_parameters() < n_plain
    torch.testing.assert_close(logits(plain, x), before, rtol=0, atol=1e-6)


def test_state_dict_round_trips_into_a_patched_model():
    a, b = llama(), llama(attention_bias=False)
    identity_query(a, scale="learned")
    identity_query(b, scale="learned")
    for n, p in a.named_parameters():
        if "gain" in n:
            p.data.uniform_(0.5, 1.5)
    b.load_state_dict(a.state_dict())  # what a Trainer checkpoint resume does
    x = tokens()
    torch.testing.assert_close(logits(b, x), logits(a, x), rtol=0, atol=1e-6)


def test_loading_a_real_w_q_into_a_patched_model_is_refused():
    patched, plain = gpt2(), gpt2()
    identity_query(patched, scale="paper")
    with pytest.raises(RuntimeError, match="not r I"):
        patched.load_state_dict(plain.state_dict())


def test_a_query_that_is_not_a_multiple_of_i_is_refused_in_one_line():
    for model in (llama(), gpt2()):
        with pytest.raises(QkvlabError) as err:
            identity_query(model)
        assert "not a multiple of I" in str(err.value) and "\n" not in str(err.value)
        assert model.num_parameters() == type(model)(model.config).num_parameters()


def test_unknown_architectures_and_shapes_are_refused():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1,
                                num_attention_heads=H, intermediate_size=48))
    with pytest.raises(QkvlabError, match="BertModel"):
        identity_query(bert, scale="paper")
    with pytest.raises(QkvlabError, match="head_dim == hidden_size"):
        identity_query(llama(head_dim=4), scale="paper")
    model = llama()
    identity_query(model, scale="paper")
    with pytest.raises(QkvlabError, match="already has W_Q = I"):
        identity_query(model, scale="paper")


def test_gqa_and_rope_forward_matches_an_explicit_identity():
    """Under GQA with RoPE the patched forward equals the stock model whose q_proj is r I."""
    model, stock = llama(), llama()
    report = identity_query(model, scale="paper")
    stock.load_state_dict(model.state_dict())  # q_proj = r I as a plain matrix
    assert torch.equal(stock.model.layers[1].self_attn.q_proj.weight,
                       report.ratios[1] * torch.eye(D))
    x = tokens(3)
    torch.testing.assert_close(logits(model, x), logits(stock, x), rtol=0, atol=1e-6)


def test_bf16_autocast_forward_runs():
    for model in (llama(), gpt2()):
        identity_query(model, scale="paper")
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            out = model(tokens()).logits
        assert torch.isfinite(out).all()


def test_approximate_keeps_the_function_as_well_as_retrofit_can():
    model = llama(num_key_value_heads=H)
    x = tokens()
    before = logits(model, x)
    calib = [tokens(s) for s in range(4)]
    report = identity_query(model, approximate="regress", calibration=calib)
    assert report.how == "approximated (retrofit regress)"
    assert not any("q_proj" in n for n, _ in model.named_parameters())
    after = logits(model, x)
    dropped = llama(num_key_value_heads=H)
    identity_query(dropped, approximate="drop")  # the control: W_Q simply removed
    err, control = (after - before).abs().mean(), (logits(dropped, x) - before).abs().mean()
    assert err < control
    with pytest.raises(QkvlabError, match="calibration"):
        identity_query(llama(), approximate="regress")


def test_trainer_steps_lower_the_loss(tmp_path):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Repeats(Dataset):  # a fixed, learnable sequence
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = (torch.arange(T) * 3 + i % 4) % V
            return {"input_ids": ids, "labels": ids}

    model = llama()
    identity_query(model, scale="paper")
    batch = Repeats()[0]
    x = batch["input_ids"][None]
    with torch.no_grad():
        start = model(input_ids=x, labels=x).loss.item()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=20, learning_rate=3e-3,
                             per_device_train_batch_size=8, report_to=[], use_cpu=True,
                             logging_steps=5, save_strategy="no", weight_decay=0.1, seed=0)
    Trainer(model=model, args=args, train_dataset=Repeats()).train()
    model.eval()
    with torch.no_grad():
        end = model(input_ids=x, labels=x).loss.item()
    assert end < start - 0.5
    assert not any("q_proj" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("setting", [float("inf"), float("-inf"), float("nan"), True, False, 0,
                                     -0.5, 1e5, 1e-9, "bogus", "1e9/sqrt(d_k)"])
def test_a_scale_a_qkvlab_config_refuses_is_refused_and_the_model_left_alone(setting):
    """One check for both ways in: model.attn_scale's bounds and spellings hold for scale=."""
    from qkvlab.model import ModelConfig

    with pytest.raises(QkvlabError, match="attn_scale"):
        ModelConfig(n_layer=L, n_head=H, n_embd=D, vocab_size=V, projection="q-identity",
                    attn_scale=setting)
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QkvlabError, match=r"^scale|^attn_scale=") as caught:
        identity_query(model, scale=setting)
    assert "\n" not in str(caught.value)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
