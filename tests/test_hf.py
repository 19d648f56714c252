"""Hugging Face interop: export to / import from transformers' GPT-2, logits equal, refusals.

Every transformers model here is built from a config locally (random weights): no download.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import refused
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.hf.export import export_checkpoint
from qkvlab.hf.gpt2 import export_problem, from_gpt2, to_gpt2
from qkvlab.hf.importer import import_model_dir
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.config import DataConfig, RunConfig
from qkvlab.run.load import load_model
from qkvlab.theory.common import randomize_

transformers = pytest.importorskip("transformers")
TOL = 1e-5
VOCAB = 48


def tiny(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB)
    base.update(kw)
    return ModelConfig(**base)


def random_gpt(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Generic weights (nonzero biases, non-unit gains): the default init would hide terms."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    randomize_(model, seed)
    with torch.no_grad():  # learned per-head logit gains, if any, away from their init of 1
        for block in model.blocks:
            if block.attn.logit_gain is not None:
                block.attn.logit_gain.copy_(torch.linspace(0.5, 2.0, cfg.n_head))
    return model.float().eval()


def save_ckpt(model: GPT, folder: Path, data_dir: Path | None = None) -> Path:
    data = DataConfig(dir=str(data_dir or folder / "no-data"), prepare_if_missing=False)
    cfg = RunConfig(model=model.cfg, data=data, out_dir=str(folder))
    return write_checkpoint(folder / "ckpt-0000010", model.state_dict(), cfg, state={"step": 10})


def tokens(cfg: ModelConfig, seed: int = 1) -> torch.Tensor:
    return torch.randint(cfg.vocab_size, (2, cfg.block_size),
                         generator=torch.Generator().manual_seed(seed))


def hf_load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_gpt2(seed: int = 0, **kw):
    """A random transformers GPT2LMHeadModel (nonzero biases, non-unit LayerNorm gains)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    base = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    base.update(kw)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**base))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@torch.no_grad()
def max_diff(ours: GPT, hf, idx: torch.Tensor) -> float:
    return float((ours(idx)[0] - hf(input_ids=idx).logits).abs().max())


# ---- export ---------------------------------------------------------------------------------

EXPORTABLE = {
    "baseline": {},
    "q-identity": dict(projection="q-identity"),
    "q-identity-wide-untied-scale": dict(projection="q-identity", mlp_hidden=144,
                                         tie_embeddings=False, attn_scale=0.3),
    "baseline-scale-bias": dict(attn_scale=0.2, bias=True),
    "q-identity-bias": dict(projection="q-identity", bias=True),
    "k-identity": dict(projection="k-identity"),
    "v-identity": dict(projection="v-identity"),
    "gqa-relu": dict(n_kv_head=2, activation="relu"),
    "shared-no-positions-gelu-tanh": dict(share_layers=True, positions="none",
                                          activation="gelu_tanh"),
    "q-identity-learned": dict(projection="q-identity", attn_scale="learned"),
    "k-identity-learned": dict(projection="k-identity", attn_scale="learned"),
    "baseline-learned-gqa": dict(attn_scale="learned", n_kv_head=2),
    # μP at 4x its base width (and 2x its depth): the tied head's readout multiplier 1/4 folds
    # into an untied head; every other multiplier already lives in the weights
    "mup-q-identity-tied": dict(projection="q-identity", parametrization="mup", base_width=8),
    "mup-baseline-completep": dict(parametrization="mup", base_width=16, base_depth=1,
                                   depth_scaling="completep"),
}


@pytest.mark.parametrize("name", list(EXPORTABLE))
def test_export_logits_equal(tmp_path, name):
    model = random_gpt(tiny(**EXPORTABLE[name]))
    ckpt = save_ckpt(model, tmp_path / "run")
    result = export_checkpoint(ckpt, tmp_path / "hf")
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "hf" / f).is_file()
    assert result.max_logit_diff is not None and result.max_logit_diff <= TOL
    hf = hf_load(tmp_path / "hf")
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert max_diff(model, hf, tokens(model.cfg)) <= TOL
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and "auto_map" not in config  # no custom code


def test_q_identity_writes_half_identity(tmp_path):
    model = random_gpt(tiny(projection="q-identity", attn_scale="paper"))
    config, tensors = to_gpt2(model)
    q = tensors["transformer.h.0.attn.c_attn.weight"][:, :32]
    assert torch.equal(q, 0.5 * torch.eye(32))
    assert config["activation_function"] == "gelu"  # exact GELU, not GPT-2's gelu_new
    assert not config["scale_attn_by_inverse_layer_idx"]


@pytest.mark.parametrize("name", ["baseline", "q-identity", "q-identity-wide-untied-scale",
                                  "k-identity", "v-identity", "baseline-scale-bias",
                                  "shared-no-positions-gelu-tanh", "mup-q-identity-tied"])
def test_export_import_round_trip(tmp_path, name):
    model = random_gpt(tiny(**EXPORTABLE[name]))
    export_checkpoint(save_ckpt(model, tmp_path / "run"), tmp_path / "hf", verify=False)
    result = import_model_dir(tmp_path / "hf", tmp_path / "back", verify=False)
    back, _ = load_model(tmp_path / "back")
    keys = ["projection", "bias", "hidden", "activation", "positions", "vocab_size",
            "block_size"]
    # a μP head tied to the embedding comes back untied, its multiplier folded in
    assert back.cfg.tie_embeddings == (model.cfg.tie_embeddings and model.readout_mult == 1)
    if model.cfg.projection != "baseline":  # a baseline's scale ratio stays folded into W_Q
        keys.append("attn_scale")
    for key in keys:
        assert getattr(back.cfg, key) == getattr(model.cfg, key), key
    assert result.model.cfg.projection == model.cfg.projection
    idx = tokens(model.cfg)
    with torch.no_grad():
        assert float((back(idx)[0] - model(idx)[0]).abs().max()) <= TOL


def test_import_without_detection_is_a_baseline(tmp_path):
    model = random_gpt(tiny(projection="q-identity"))
    export_checkpoint(save_ckpt(model, tmp_path / "run"), tmp_path / "hf", verify=False)
    result = import_model_dir(tmp_path / "hf", tmp_path / "back", detect=False, verify=False)
    assert result.model.cfg.projection == "baseline" and result.model.cfg.bias
    with torch.no_grad():
        idx = tokens(model.cfg)
        assert float((result.model(idx)[0] - model(idx)[0]).abs().max()) <= TOL


@pytest.mark.parametrize("kw,reason", [
    (dict(positions="rope"), "rope"),
    (dict(norm="rmsnorm"), "rmsnorm"),
    (dict(projection="nonlinear-q"), "nonlinear query"),
    (dict(residual="attention"), "residual=attention"),
    (dict(causal=False), "bidirectional"),
])
def test_export_refuses_with_reason(tmp_path, kw, reason):
    model = random_gpt(tiny(**kw))
    assert reason in export_problem(model.cfg)
    with pytest.raises(QkvlabError, match=reason) as err:
        export_checkpoint(save_ckpt(model, tmp_path / "run"), tmp_path / "hf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_export_refuses_foreign_out_dir(tmp_path):
    model = random_gpt(tiny())
    ckpt = save_ckpt(model, tmp_path / "run")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(QkvlabError, match="not a qkvlab export"):
        export_checkpoint(ckpt, tmp_path / "other")
    export_checkpoint(ckpt, tmp_path / "hf", verify=False)
    export_checkpoint(ckpt, tmp_path / "hf", verify=False)  # an earlier export is replaced


def test_reexport_refuses_a_folder_holding_what_the_user_added(data_dir, tmp_path, capsys):
    """An earlier export is replaced as a whole: files qkvlab did not write stop it, before
    anything is written, and stay where they are."""
    ckpt = save_ckpt(random_gpt(tiny()), tmp_path / "run", data_dir)  # its char tokenizer
    out = tmp_path / "exp" / "m"
    assert main(["export", str(ckpt), "--format", "hf", str(out), "--no-verify"]) == 0
    weights = (out / "model.safetensors").read_bytes()
    mode = (out / "config.json").stat().st_mode & 0o777  # the weights follow the umask too
    assert (out / "model.safetensors").stat().st_mode & 0o777 == mode
    (out / "NOTES.md").write_text("my notes")
    (out / "checkpoint-500").mkdir()
    (out / "checkpoint-500" / "trainer_state.json").write_text("{}")
    err = refused(capsys, ["export", str(ckpt), "--format", "hf", str(out), "--no-verify"])
    assert "NOTES.md" in err and "checkpoint-500/" in err and "choose a new folder" in err
    assert (out / "NOTES.md").read_text() == "my notes"
    assert (out / "checkpoint-500" / "trainer_state.json").is_file()
    assert (out / "model.safetensors").read_bytes() == weights
    assert [p.name for p in out.parent.iterdir()] == ["m"]  # no temp folder left either
    (out / "NOTES.md").unlink()
    (out / "checkpoint-500" / "trainer_state.json").unlink()
    (out / "checkpoint-500").rmdir()
    assert main(["export", str(ckpt), "--format", "hf", str(out), "--no-verify"]) == 0
    # everything an export writes is a name a re-export may replace
    from qkvlab.hf.export import EXPORT_NAMES, QKVLAB_TOKENIZER_DIR, QKVLAB_TOKENIZER_NAMES

    assert {p.name for p in out.iterdir() if p.is_file()} <= EXPORT_NAMES
    assert {p.name for p in (out / QKVLAB_TOKENIZER_DIR).iterdir()} <= QKVLAB_TOKENIZER_NAMES


# ---- import ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {},  # GPT-2's own gelu_new, tied head
    dict(activation_function="gelu", tie_word_embeddings=False),
    dict(activation_function="relu", n_inner=80),
    dict(scale_attn_weights=False, attn_pdrop=0.0),
])
def test_import_gpt2_logits_equal(tmp_path, kw):
    hf = hf_gpt2(**kw)
    hf.save_pretrained(tmp_path / "gpt2")
    assert (tmp_path / "gpt2" / "model.safetensors").is_file()
    result = import_model_dir(tmp_path / "gpt2", tmp_path / "ckpt")
    assert result.max_logit_diff is not None and result.max_logit_diff <= TOL
    ours, ckpt = load_model(tmp_path / "ckpt")
    assert ours.cfg.projection == "baseline" and ours.cfg.bias
    assert ckpt.state["kind"] == "imported"
    assert max_diff(ours, hf, tokens(ours.cfg)) <= TOL
    # and back out again: qkvlab -> transformers gives the same logits as the original
    export_checkpoint(tmp_path / "ckpt", tmp_path / "again")
    assert max_diff(ours, hf_load(tmp_path / "again"), tokens(ours.cfg, 5)) <= TOL


def test_import_sharded_safetensors(tmp_path):
    hf = hf_gpt2(seed=2)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    result = import_model_dir(tmp_path / "sharded", tmp_path / "ckpt", verify=False)
    assert max_diff(result.model, hf, tokens(result.model.cfg)) <= TOL


def test_import_gpt2_model_without_lm_prefix(tmp_path):
    """A GPT2Model-style checkpoint (keys without `transformer.`, tied head) imports too."""
    hf = hf_gpt2()
    config, _ = to_gpt2(random_gpt(tiny()))
    tensors = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()
               if k != "lm_head.weight"}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)  # old causal-mask buffer: ignored
    model, _ = from_gpt2(hf.config.to_dict(), tensors)
    assert max_diff(model, hf, tokens(model.cfg)) <= TOL
    assert config["model_type"] == "gpt2"


def _error(fn, *args, **kw) -> str:
    with pytest.raises(QkvlabError) as err:
        fn(*args, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_import_refusals(tmp_path):
    hf = hf_gpt2()
    good = tmp_path / "good"
    hf.save_pretrained(good)
    config = json.loads((good / "config.json").read_text())

    assert "does not exist" in _error(import_model_dir, tmp_path / "nope", tmp_path / "o")
    assert "no config.json" in _error(import_model_dir, tmp_path, tmp_path / "o")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    msg = _error(import_model_dir, pickled, tmp_path / "o")
    assert "never unpickles" in msg and "safetensors" in msg

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(config))
    assert "weights are missing" in _error(import_model_dir, empty, tmp_path / "o")

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama",
                                                   "architectures": ["LlamaForCausalLM"]}))
    msg = _error(import_model_dir, llama, tmp_path / "o")
    assert "model_type='llama'" in msg and "GPT-2" in msg

    for change, text in ((dict(vocab_size=VOCAB + 2), "mismatched vocabularies"),
                         (dict(n_layer=3), "lack"),
                         (dict(scale_attn_by_inverse_layer_idx=True), "1/(l+1)"),
                         (dict(add_cross_attention=True), "cross-attention"),
                         (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon"),
                         (dict(activation_function="swish"), "activation_function")):
        bad = tmp_path / f"bad-{next(iter(change))}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        assert text in _error(import_model_dir, bad, tmp_path / "o")

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    assert "not valid JSON" in _error(import_model_dir, garbage, tmp_path / "o")

    bigtok = tmp_path / "bigtok"
    hf.save_pretrained(bigtok)
    vocab = {f"t{i}": i for i in range(VOCAB + 10)}
    (bigtok / "vocab.json").write_text(json.dumps(vocab))
    (bigtok / "merges.txt").write_text("#version: 0.2\n")
    assert "mismatched vocabularies" in _error(import_model_dir, bigtok, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_cli_export_and_import(tmp_path, capsys):
    model = random_gpt(tiny(projection="q-identity", attn_scale="paper"))
    ckpt = save_ckpt(model, tmp_path / "run")
    assert main(["export", str(ckpt), "--format", "hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "0.5 I in the query block" in out and "verified with transformers" in out
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert "projection=q-identity" in capsys.readouterr().out
    assert main(["import-hf", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkvlab import-hf: error:") and "\n" not in err
    rope = save_ckpt(random_gpt(tiny(positions="rope")), tmp_path / "rope")
    assert main(["export", str(rope), str(tmp_path / "hf2")]) == 2
    assert "rope" in capsys.readouterr().err


# ---- tokenizers -----------------------------------------------------------------------------

def _with_tokenizer(tmp_path: Path, tok, cfg: ModelConfig) -> Path:
    """A checkpoint whose run folder carries `tok`'s tables (as training copies them)."""
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    tok.save(run / "tokenizer")
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_token": tok.eot_token}
    (run / "tokenizer" / "meta.json").write_text(json.dumps(meta))
    return save_ckpt(random_gpt(cfg), run)


def test_char_tokenizer_has_no_hf_files_but_round_trips(tmp_path):
    from qkvlab.data.tokenizer import CharTokenizer
    from qkvlab.run.load import run_tokenizer

    tok = CharTokenizer("abcdefgh \n")
    ckpt = _with_tokenizer(tmp_path, tok, tiny())
    result = export_checkpoint(ckpt, tmp_path / "hf", verify=False)
    assert "no standard Hugging Face" in result.tokenizer_note
    assert not (tmp_path / "hf" / "vocab.json").exists()
    assert (tmp_path / "hf" / "qkvlab_tokenizer" / "char_vocab.json").is_file()
    import_model_dir(tmp_path / "hf", tmp_path / "back", verify=False)
    _, back = load_model(tmp_path / "back")
    assert run_tokenizer(back).encode("bad cafe") == tok.encode("bad cafe")


def test_bpe_tokenizer_exports_as_tokenizer_json(tmp_path):
    from transformers import AutoTokenizer

    from qkvlab.data.tokenizer import BPETokenizer

    text = ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30]
    tok = BPETokenizer.train(text, 300)
    ckpt = _with_tokenizer(tmp_path, tok, tiny(vocab_size=320))
    export_checkpoint(ckpt, tmp_path / "hf", verify=False)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sample = "the lazy fox says hello"
    assert hf_tok(sample)["input_ids"] == tok.encode(sample)


def test_gpt2_tokenizer_exports_vocab_and_merges(tmp_path):
    from qkvlab.data.cache import cache_dir

    if not (cache_dir() / "gpt2-encoder.json").is_file():
        pytest.skip("GPT-2 BPE tables not cached (no download in tests)")
    from transformers import AutoTokenizer

    from qkvlab.data.tokenizer import GPT2Tokenizer

    tok = GPT2Tokenizer()
    ckpt = _with_tokenizer(tmp_path, tok, tiny(vocab_size=50304, n_embd=16, n_layer=1))
    export_checkpoint(ckpt, tmp_path / "hf", verify=False)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sample = "Hello world, it's a test: 1234 'quoted'  spaces."
    assert hf_tok(sample)["input_ids"] == tok.encode(sample)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == 50256
    result = import_model_dir(tmp_path / "hf", tmp_path / "back", verify=False)
    assert "GPT-2" in result.tokenizer_note or "gpt2" in result.tokenizer_note


def test_mismatched_tokenizer_vocab_refused_on_export(tmp_path):
    from qkvlab.data.tokenizer import CharTokenizer

    tok = CharTokenizer("abcdefghijklmnop")
    ckpt = _with_tokenizer(tmp_path, tok, tiny(vocab_size=8))
    assert "mismatched vocabularies" in _error(export_checkpoint, ckpt, tmp_path / "hf")


# ---- lm-eval --------------------------------------------------------------------------------

def test_lm_eval_missing_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    ckpt = save_ckpt(random_gpt(tiny()), tmp_path / "run")
    assert main(["eval", str(ckpt), "--lm-eval", "hellaswag"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pip install lm-eval" in err and "hub" in err


def test_lm_eval_runs_on_an_export(tmp_path, capsys, monkeypatch):
    from qkvlab.data.tokenizer import BPETokenizer

    calls = []

    def simple_evaluate(**kw):
        pretrained = kw["model_args"].split("pretrained=")[1].split(",")[0]
        assert (Path(pretrained) / "config.json").is_file()
        assert (Path(pretrained) / "tokenizer.json").is_file()
        calls.append(kw)
        return {"results": {t: {"acc,none": 0.25} for t in kw["tasks"]}}

    fake = types.ModuleType("lm_eval")
    fake.simple_evaluate = simple_evaluate
    monkeypatch.setitem(sys.modules, "lm_eval", fake)
    monkeypatch.setitem(sys.modules, "lm_eval.utils", None)  # no make_table: JSON output
    tok = BPETokenizer.train(["some words and more words " * 20], 300)
    ckpt = _with_tokenizer(tmp_path, tok, tiny(vocab_size=320, projection="q-identity"))
    assert main(["eval", str(ckpt), "--lm-eval", "arc_easy, piqa", "--lm-eval-limit", "3"]) == 0
    assert calls and calls[0]["model"] == "hf" and calls[0]["tasks"] == ["arc_easy", "piqa"]
    assert calls[0]["limit"] == 3
    assert "acc,none" in capsys.readouterr().out
    char = save_ckpt(random_gpt(tiny()), tmp_path / "char")
    assert main(["eval", str(char), "--lm-eval", "piqa"]) == 2
    assert "needs a Hugging Face tokenizer" in capsys.readouterr().err
