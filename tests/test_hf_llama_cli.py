"""`qkvlab export` / `import-hf` / `retrofit` on Llama-style models, through the CLI: a
Llama-style checkpoint exports as a plain LlamaForCausalLM, a transformers Llama imports with
equal logits, what Llama or qkvlab cannot hold is refused on one line with nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import refused, tiny_overrides
from qkvlab.cli import main
from qkvlab.model.attention_layout import Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.config import DataConfig, RunConfig, load_config
from qkvlab.run.load import load_model
from qkvlab.train.trainer import train
from test_hf_llama import llama_cfg, random_llama

transformers = pytest.importorskip("transformers")
VOCAB = 48
TOL = 1e-4


def llama_model(**kw) -> GPT:
    """A random Llama-style qkvlab model (generic weights, learned gains away from 1)."""
    return random_llama(llama_cfg(**kw))


def save_ckpt(model: GPT, run: Path) -> Path:
    data = DataConfig(dir=str(run / "no-data"), prepare_if_missing=False)
    cfg = RunConfig(model=model.cfg, data=data, out_dir=str(run))
    return write_checkpoint(run / "ckpt-0000010", model.state_dict(), cfg, state={"step": 10})


def hf_load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                             dtype=torch.float32).eval()


@torch.no_grad()
def max_diff(ours: GPT, hf, seed: int = 1) -> float:
    idx = torch.randint(ours.cfg.vocab_size, (2, ours.cfg.block_size),
                        generator=torch.Generator().manual_seed(seed))
    return float((ours(idx)[0] - hf(input_ids=idx).logits).abs().max())


def verified(text: str) -> float:
    return float(re.search(r"max \|logit diff\| (\S+)", text).group(1))



def no_leftovers(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def llama_run(data_dir, tmp_path_factory) -> Path:
    """The shakespeare-char-llama preset (RMSNorm, RoPE, SwiGLU, baseline W_Q) at 2 x 32,
    trained for 8 steps."""
    run = tmp_path_factory.mktemp("runs") / "llama"
    train(load_config("shakespeare-char-llama", tiny_overrides(data_dir, f"run.out_dir={run}")),
          quiet=True)
    return run


# ---- export -------------------------------------------------------------------------------

def test_trained_llama_preset_exports_as_llama_and_imports_back(llama_run, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    assert main(["export", str(llama_run), "--format", "hf", str(hf_dir)]) == 0
    text = capsys.readouterr().out
    assert "transformers LlamaForCausalLM" in text and verified(text) <= TOL
    hf = hf_load(hf_dir)
    assert type(hf) is transformers.LlamaForCausalLM
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config  # no custom code
    assert (hf_dir / "model.safetensors").is_file()
    ours, _ = load_model(llama_run)
    assert max_diff(ours, hf) <= TOL
    # and back: the same function, the char tokenizer restored from qkvlab_tokenizer/
    assert main(["import-hf", str(hf_dir), "--out", str(tmp_path / "back")]) == 0
    text = capsys.readouterr().out
    assert "LlamaForCausalLM" in text and verified(text) <= TOL
    back, ckpt = load_model(tmp_path / "back")
    assert (back.cfg.norm, back.cfg.positions, back.cfg.mlp) == ("rmsnorm", "rope", "swiglu")
    assert (tmp_path / "back" / "tokenizer" / "meta.json").is_file()
    assert max_diff(back, hf, seed=3) <= TOL
    assert main(["eval", str(tmp_path / "back"), "--windows", "4"]) == 0  # its data is recorded


@pytest.mark.parametrize("kw, note, back_as", [
    (dict(projection="q-identity", attn_scale="paper"), "W_Q = I written as 0.5 I in q_proj",
     "q-identity"),
    # per-head gains make q_proj diag(r g_h), no multiple of I: the same function as a matrix
    (dict(projection="q-identity", attn_scale="learned", n_kv_head=2, tie_embeddings=False),
     "gains folded into q_proj", "baseline"),
    (dict(projection="k-identity", share_layers=True, attn_scale="paper"),
     "W_K = I written as 0.5 I in k_proj",
     "k-identity"),
])
def test_identity_schemes_export_as_llama_with_equal_logits(tmp_path, capsys, kw, note,
                                                            back_as):
    model = llama_model(**kw)
    ckpt = save_ckpt(model, tmp_path / "run")
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    text = capsys.readouterr().out
    assert note in text and verified(text) <= TOL
    hf = hf_load(tmp_path / "hf")
    assert type(hf) is transformers.LlamaForCausalLM
    assert hf.config.num_key_value_heads == model.cfg.kv_heads
    assert max_diff(model, hf) <= TOL
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back, _ = load_model(tmp_path / "back")
    assert back.cfg.projection == back_as
    assert max_diff(back, hf, seed=2) <= TOL


def test_bpe_tokenizer_exports_with_the_llama(tmp_path, capsys):
    from transformers import AutoTokenizer

    from qkvlab.data.tokenizer import BPETokenizer

    tok = BPETokenizer.train(["the quick brown fox jumps over the lazy dog " * 20], 300)
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    tok.save(run / "tokenizer")
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_token": tok.eot_token}
    (run / "tokenizer" / "meta.json").write_text(json.dumps(meta))
    ckpt = save_ckpt(llama_model(vocab_size=320, projection="q-identity"), run)
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    sample = "the lazy fox jumps"
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(sample)["input_ids"] == \
        tok.encode(sample)


def test_a_model_neither_can_hold_is_refused_with_both_reasons(tmp_path, capsys):
    for kw in (dict(norm="layernorm"), dict(projection="nonlinear-q")):
        ckpt = save_ckpt(llama_model(**kw), tmp_path / f"run-{next(iter(kw))}")
        err = refused(capsys, ["export", str(ckpt), str(tmp_path / "hf")])
        assert "GPT-2" in err and "Llama" in err
        assert not (tmp_path / "hf").exists()



def test_an_export_whose_logits_differ_is_not_written(tmp_path, capsys, monkeypatch):
    from qkvlab.hf import export

    ckpt = save_ckpt(llama_model(projection="q-identity"), tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    real = export.to_llama

    def off_by_a_bit(model, **kw):  # a mapping bug: one norm gain slightly wrong
        config, tensors = real(model, **kw)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
        return config, tensors

    monkeypatch.setattr(export, "to_llama", off_by_a_bit)
    err = refused(capsys, ["export", str(ckpt), str(out)])
    assert "different logits" in err and "nothing was written" in err
    assert (out / "model.safetensors").read_bytes() == before and no_leftovers(tmp_path)
    err = refused(capsys, ["export", str(ckpt), str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and no_leftovers(tmp_path)

# ---- import -------------------------------------------------------------------------------

def hf_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=0, **kw)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases away from their init, so they are checked too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kw", [{}, dict(num_key_value_heads=2, tie_word_embeddings=True),
                                dict(attention_bias=True, mlp_bias=True)])
def test_import_of_a_transformers_llama_has_equal_logits(tmp_path, capsys, kw):
    hf = hf_llama(**kw)
    hf.save_pretrained(tmp_path / "llama")
    out = tmp_path / "ckpt"
    assert main(["import-hf", str(tmp_path / "llama"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LlamaForCausalLM" in text and verified(text) <= TOL
    ours, ckpt = load_model(out)
    assert ckpt.state["kind"] == "imported" and ckpt.config.train.dtype == "fp32"
    assert ours.cfg.kv_heads == hf.config.num_key_value_heads
    assert max_diff(ours, hf) <= TOL


def write_llama_dir(folder: Path, change: dict) -> Path:
    hf_llama().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return folder


@pytest.mark.parametrize("change, needle", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(attention_bias=True, mlp_bias=False), "attention_bias"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps"),
    (dict(torch_dtype="bogus"), "torch_dtype"),
])
def test_configs_qkvlab_cannot_reproduce_are_refused(tmp_path, capsys, change, needle):
    folder = write_llama_dir(tmp_path / "llama", change)
    err = refused(capsys, ["import-hf", str(folder), "--out", str(tmp_path / "ckpt")])
    assert needle in err
    assert not (tmp_path / "ckpt").exists() and no_leftovers(tmp_path)


def test_a_pickle_only_folder_is_refused(tmp_path, capsys):
    folder = write_llama_dir(tmp_path / "llama", {})
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    err = refused(capsys, ["import-hf", str(folder), "--out", str(tmp_path / "ckpt")])
    assert "never unpickles" in err and "safetensors" in err
    assert not (tmp_path / "ckpt").exists() and no_leftovers(tmp_path)


def test_weights_that_do_not_match_the_config_are_refused(tmp_path, capsys):
    folder = write_llama_dir(tmp_path / "llama", {"intermediate_size": 64})
    err = refused(capsys, ["import-hf", str(folder), "--out", str(tmp_path / "ckpt")])
    assert "do not match config.json" in err
    folder = write_llama_dir(tmp_path / "llama2", {"vocab_size": VOCAB + 2})
    assert "mismatched vocabularies" in refused(
        capsys, ["import-hf", str(folder), "--out", str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt").exists()


# ---- retrofit -----------------------------------------------------------------------------

def test_retrofit_of_a_llama_style_checkpoint_writes_a_healed_llama(llama_run, tmp_path,
                                                                    capsys):
    out = tmp_path / "rf"
    assert main(["retrofit", str(llama_run), "--steps", "2", "--windows", "4",
                 "--calib-batches", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| converted, init regress | 0 |" in text and "nan" not in text
    model, ckpt = load_model(out)
    assert ckpt.state["kind"] == "retrofit"
    assert (model.cfg.projection, model.cfg.norm, model.cfg.positions, model.cfg.mlp) == \
        ("q-identity", "rmsnorm", "rope", "swiglu")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # and it is still a Llama: q_proj = 0.5 I
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    assert "W_Q = I written as 0.5 I in q_proj" in capsys.readouterr().out
    hf = hf_load(tmp_path / "hf")
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, 0.5 * torch.eye(q.shape[0]))


def test_regress_under_rope_folds_into_the_keys_exactly():
    """Under RoPE the regress init fits each head's query map A_h among the maps the rotations
    commute with (a scaled rotation per channel pair): then W_Q^(h) = A_h folded into the keys
    is exact, so the student equals the source with its W_Q replaced by the fitted maps."""
    import copy

    from qkvlab.retrofit.init import attention_moments, build_student
    from qkvlab.theory.common import random_model

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=12, vocab_size=VOCAB,
                      norm="rmsnorm", positions="rope", mlp="swiglu", mlp_hidden=64)
    model = random_model(cfg, seed=3)
    batches = [torch.randint(VOCAB, (4, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    student, info = build_student(model, "regress", attention_moments(model, batches))
    assert "RoPE" in info.note
    d, dk = cfg.n_embd, cfg.d_head
    ratio = model.cfg.scale / student.cfg.scale
    fitted = copy.deepcopy(model)
    with torch.no_grad():
        for blk, sblk, fblk in zip(model.blocks, student.blocks, fitted.blocks, strict=True):
            wk = blk.attn.projections().w_k.double()  # (out, in) rows of each head's key
            wk_student = sblk.attn.projections().w_k.double()  # = ratio * A_h @ wk, per head
            wq = torch.zeros(d, d, dtype=torch.float64)  # Linear (out, in)
            for h in range(cfg.n_head):
                sl = slice(h * dk, (h + 1) * dk)
                A = wk_student[sl] @ torch.linalg.pinv(wk[sl]) / ratio
                wq[sl, sl] = A.T  # the query u_h A_h, as Linear rows
            fblk.attn.load_projections(Projections(w_q=wq))
    idx = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert float((student(idx)[0] - fitted(idx)[0]).abs().max()) < 1e-6
