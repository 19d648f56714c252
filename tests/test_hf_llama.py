"""Llama-style qkvlab models <-> transformers' LlamaForCausalLM: exact logits both ways, for
every scheme a Llama can hold, and one-line refusals for what qkvlab does not compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qkvlab.errors import QkvlabError
from qkvlab.hf.llama import check_llama_config, from_llama, llama_problem, to_llama
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.model.params import count_params
from qkvlab.theory.common import randomize_

transformers = pytest.importorskip("transformers")
VOCAB = 48
TOL = 1e-4


def llama_cfg(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB,
                norm="rmsnorm", positions="rope", mlp="swiglu", mlp_hidden=64)
    return ModelConfig(**{**base, **kw})


def random_llama(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    randomize_(model, seed)
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.logit_gain is not None:
                block.attn.logit_gain.copy_(torch.linspace(0.5, 2.0, cfg.n_head))
    return model.float().eval()


def write_hf(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


SCHEMES = {
    "baseline": {},
    "q-identity": dict(projection="q-identity"),
    "q-identity-learned": dict(projection="q-identity", attn_scale="learned"),
    "q-identity-matched-gqa-untied": dict(projection="q-identity", attn_scale="matched",
                                          n_kv_head=2, tie_embeddings=False),
    "k-identity": dict(projection="k-identity"),
    "v-identity-bias": dict(projection="v-identity", bias=True),
    "gqa-shared": dict(n_kv_head=1, share_layers=True),
    # μP at 4x its base width: the tied head's readout multiplier 1/4 folds into an untied head
    "mup-q-identity-tied": dict(projection="q-identity", parametrization="mup", base_width=8),
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_export_loads_as_llama_with_equal_logits_and_tokens(tmp_path, name):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = random_llama(llama_cfg(**SCHEMES[name]))
    config, tensors = to_llama(model)
    hf = AutoModelForCausalLM.from_pretrained(str(write_hf(tmp_path, config, tensors)),
                                              dtype=torch.float32).eval()
    assert type(hf) is LlamaForCausalLM
    idx = tokens()
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(input_ids=idx).logits
    assert float((ours - theirs).abs().max()) <= TOL
    prompt = idx[:1, :4]
    with torch.no_grad():
        hf_out = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        seq = prompt
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(hf_out, seq)


@pytest.mark.parametrize("kw", [{}, dict(num_key_value_heads=2, tie_word_embeddings=True),
                                dict(attention_bias=True, mlp_bias=True)])
def test_import_of_a_transformers_llama_has_equal_logits(tmp_path, kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                         **kw)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases away from their init, so they are checked too
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    from qkvlab.hf.importer import read_weights

    saved = json.loads((tmp_path / "config.json").read_text())
    model = from_llama(saved, read_weights(tmp_path))
    idx = tokens()
    with torch.no_grad():
        assert float((model(idx)[0] - hf(input_ids=idx).logits).abs().max()) <= TOL
    assert model.cfg.norm_eps == pytest.approx(config.rms_norm_eps)


def test_round_trip_keeps_the_identity_query():
    model = random_llama(llama_cfg(projection="q-identity", attn_scale="matched"))
    back = from_llama(*to_llama(model))
    assert back.cfg.projection == "q-identity"
    assert back.cfg.scale == pytest.approx(model.cfg.scale, rel=1e-6)
    assert count_params(back.cfg).attn_q == 0


@pytest.mark.parametrize("change, needle", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(attention_bias=True, mlp_bias=False), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_size="32"), "hidden_size"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings"),
    (dict(model_type="mistral"), "model_type"),
])
def test_configs_qkvlab_cannot_reproduce_are_refused(change, needle):
    config, _ = to_llama(random_llama(llama_cfg()))
    with pytest.raises(QkvlabError, match=needle):
        check_llama_config({**config, **change})


def test_a_tied_config_with_a_different_stored_head_is_refused():
    config, tensors = to_llama(random_llama(llama_cfg()))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    with pytest.raises(QkvlabError, match="tie_word_embeddings"):
        from_llama(config, tensors)


@pytest.mark.parametrize("kw, needle", [
    (dict(norm="layernorm"), "RMSNorm"), (dict(positions="learned"), "RoPE"),
    (dict(mlp="gelu"), "SwiGLU"), (dict(projection="nonlinear-q"), "nonlinear"),
    (dict(causal=False), "bidirectional"), (dict(residual="attention"), "residual"),
])
def test_export_refuses_what_llama_cannot_hold(kw, needle):
    assert needle in llama_problem(llama_cfg(**kw))


def test_swiglu_default_width_keeps_the_gelu_mlps_parameters():
    # d = 384: 2/3 * 4 * 384 = 1,024 hidden units, 3 * 384 * 1,024 = 2 * 384 * 1,536 weights
    swiglu = ModelConfig(n_embd=384, n_head=6, mlp="swiglu")
    gelu = ModelConfig(n_embd=384, n_head=6)
    assert swiglu.hidden == 1024
    assert count_params(swiglu).mlp == count_params(gelu).mlp == 6 * 3 * 384 * 1024
    # d = 256: 682.7 rounds to 704 (a multiple of 64); counted by hand per layer
    small = ModelConfig(n_layer=1, n_embd=256, n_head=4, mlp="swiglu", norm="rmsnorm",
                        positions="rope", vocab_size=65, block_size=128)
    assert small.hidden == 704
    by_hand = (65 * 256  # tied embedding, no position table
               + 256 * 768 + 256 * 256  # in_proj (q, k, v) and out_proj, no biases
               + 256 * 2 * 704 + 704 * 256  # [gate | up] and down
               + 3 * 256)  # two RMSNorm gains and the final one
    assert count_params(small).total == by_hand == sum(p.numel() for p in GPT(small).parameters())
