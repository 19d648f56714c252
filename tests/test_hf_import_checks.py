"""`qkvlab import-hf` refuses what it cannot reproduce (one line, exit 2, nothing written), and an
imported model evaluates and retrofits like a trained one.

Every transformers model here is built from a config locally (random weights): no download.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import refused
from qkvlab.cli import main
from qkvlab.run.load import load_model

transformers = pytest.importorskip("transformers")
VOCAB = 48  # covers the conftest char dataset's vocabulary


def hf_gpt2(**kw):
    """A random transformers GPT2LMHeadModel (nonzero biases, non-unit LayerNorm gains)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    base = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**base, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture
def gpt2_dir(tmp_path) -> Path:
    folder = tmp_path / "gpt2"
    hf_gpt2().save_pretrained(folder)
    return folder



def leftovers(folder: Path) -> list[str]:
    """Temporary folders an import could leave next to its destination."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ---- (a) a tied config whose weights hold another head ------------------------------------

def test_tied_config_with_a_different_stored_head_is_refused(tmp_path, gpt2_dir, capsys):
    tensors = load_file(str(gpt2_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # transformers stores a tied head once
    tensors["lm_head.weight"] = torch.randn_like(tensors["transformer.wte.weight"])
    save_file(tensors, str(gpt2_dir / "model.safetensors"), metadata={"format": "pt"})
    err = refused(capsys, ["import-hf", str(gpt2_dir), "--out", str(tmp_path / "ckpt")])
    assert "tie_word_embeddings" in err and "lm_head.weight" in err
    assert not (tmp_path / "ckpt").exists() and leftovers(tmp_path) == []
    # the same head stored twice is just the tied model
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, str(gpt2_dir / "model.safetensors"), metadata={"format": "pt"})
    assert main(["import-hf", str(gpt2_dir), "--out", str(tmp_path / "ckpt")]) == 0


def test_logits_that_differ_fail_the_import_and_keep_the_old_checkpoint(
        tmp_path, gpt2_dir, capsys, monkeypatch):
    from qkvlab.hf import importer

    out = tmp_path / "runs" / "ckpt"
    assert main(["import-hf", str(gpt2_dir), "--out", str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    real = importer.from_gpt2

    def off_by_a_bit(config, tensors, **kw):  # a mapping bug: one bias slightly wrong
        model, notes = real(config, tensors, **kw)
        with torch.no_grad():
            model.norm_f.bias.add_(0.01)
        return model, notes

    monkeypatch.setattr(importer, "from_gpt2", off_by_a_bit)
    err = refused(capsys, ["import-hf", str(gpt2_dir), "--out", str(out)])
    assert "different logits" in err and "nothing was written" in err
    assert (out / "model.safetensors").read_bytes() == before  # the earlier import is intact
    assert leftovers(out.parent) == []
    err = refused(capsys, ["import-hf", str(gpt2_dir), "--out", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def test_a_failure_inside_the_logit_check_leaves_nothing(tmp_path, gpt2_dir, capsys,
                                                          monkeypatch):
    from qkvlab.hf import export

    def broken(model_dir):
        raise RuntimeError("simulated failure\nsecond line")

    monkeypatch.setattr(export, "load_hf_model", broken)
    err = refused(capsys, ["import-hf", str(gpt2_dir), "--out", str(tmp_path / "ckpt")])
    assert "transformers could not load" in err and "simulated failure" in err
    assert not (tmp_path / "ckpt").exists() and leftovers(tmp_path) == []


# ---- (b) wrongly typed config.json fields -------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("initializer_range", "abc"),
    ("resid_pdrop", "x"),
    ("attn_pdrop", 1.5),
    ("layer_norm_epsilon", "abc"),
    ("layer_norm_epsilon", [1e-5]),
    ("activation_function", ["gelu"]),
    ("tie_word_embeddings", "false"),  # bool("false") would be True
    ("scale_attn_weights", 1),
    ("torch_dtype", "bogus"),
    ("dtype", "float8"),
    ("n_inner", "64"),
    ("eos_token_id", -1),
    ("architectures", "GPT2LMHeadModel"),
])
def test_wrongly_typed_fields_are_refused_naming_the_field(tmp_path, gpt2_dir, capsys,
                                                           field, value):
    config = json.loads((gpt2_dir / "config.json").read_text())
    (gpt2_dir / "config.json").write_text(json.dumps({**config, field: value}))
    err = refused(capsys, ["import-hf", str(gpt2_dir), "--out", str(tmp_path / "ckpt")])
    assert f"config.json: {field} must be" in err
    assert not (tmp_path / "ckpt").exists() and leftovers(tmp_path) == []


def test_null_fields_transformers_defaults_are_accepted(tmp_path, gpt2_dir):
    config = json.loads((gpt2_dir / "config.json").read_text())
    config.update(n_inner=None, pad_token_id=None, torch_dtype=None, dtype="float32")
    (gpt2_dir / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(gpt2_dir), "--out", str(tmp_path / "ckpt")]) == 0


# ---- (c) an imported checkpoint without a tokenizer: eval and retrofit with --data ----------

def test_imported_without_tokenizer_says_to_pass_data(tmp_path, gpt2_dir, capsys):
    out = tmp_path / "ckpt"
    assert main(["import-hf", str(gpt2_dir), "--out", str(out)]) == 0
    for args in (["eval", str(out)], ["retrofit", str(out), "--steps", "1"]):
        err = refused(capsys, args)
        assert "--data DIR" in err and "qkvlab prepare" in err, args
        assert "--tokenizer unknown" not in err, args
    # --data that is no prepared folder: one line too
    err = refused(capsys, ["eval", str(out), "--data", str(tmp_path)])
    assert "not a prepared data folder" in err


def test_eval_and_retrofit_of_an_imported_model_on_prepared_data(tmp_path, gpt2_dir, data_dir,
                                                                 capsys):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["vocab_size"] <= VOCAB
    out = tmp_path / "ckpt"
    assert main(["import-hf", str(gpt2_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--data", str(data_dir), "--windows", "8"]) == 0
    assert "val loss" in capsys.readouterr().out
    healed = tmp_path / "healed"
    assert main(["retrofit", str(out), "--data", str(data_dir), "--steps", "2",
                 "--batch-size", "4", "--windows", "8", "--calib-batches", "1",
                 "--out", str(healed)]) == 0
    text = capsys.readouterr().out
    assert "gap to the original" in text and "nan" not in text
    model, ckpt = load_model(healed)
    assert model.cfg.projection == "q-identity" and ckpt.state["kind"] == "retrofit"
    # the healed checkpoint names the data it was healed on: eval needs no --data
    assert ckpt.config.data.dir == str(data_dir) and ckpt.config.data.tokenizer == "char"
    assert main(["eval", str(healed), "--windows", "8"]) == 0
    # data with more tokens than the model has is refused, not indexed out of range
    small = tmp_path / "small"
    hf_gpt2(vocab_size=8).save_pretrained(small)
    assert main(["import-hf", str(small), "--out", str(tmp_path / "small-ckpt")]) == 0
    err = refused(capsys, ["retrofit", str(tmp_path / "small-ckpt"), "--data", str(data_dir),
                           "--steps", "1"])
    assert "vocab" in err


# ---- (d) help, the report, eval precision -------------------------------------------------

def test_retrofit_help_states_the_windows_cap_the_code_uses(capsys):
    from qkvlab.retrofit.checkpoint import MAX_DEFAULT_WINDOWS

    assert main(["retrofit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"at most {MAX_DEFAULT_WINDOWS})" in text


def test_report_when_conversion_does_not_raise_the_loss(capsys):
    from qkvlab.commands.retrofit import _print_report
    from qkvlab.retrofit.checkpoint import RetrofitReport
    from qkvlab.retrofit.heal import HealConfig, HealResult
    from qkvlab.retrofit.init import InitInfo

    hc = HealConfig(steps=4)
    for after_convert in (2.0, 1.9):  # no change, and a lower loss
        report = RetrofitReport(source=Path("src"), init="regress",
                                init_info=InitInfo("regress", "note"), heal_config=hc,
                                before=2.0, heal_result=HealResult([(0, after_convert),
                                                                    (4, 1.8)]))
        _print_report(report, hc, "q-identity")
        text = capsys.readouterr().out
        assert "conversion did not raise the loss" in text and "nan" not in text
        assert "-0.2000 after healing" in text


def test_imported_model_evaluates_in_float32(tmp_path, gpt2_dir, data_dir, capsys):
    from qkvlab.commands.train import EvalOptions, eval_dtype
    from qkvlab.data.loader import TokenData
    from qkvlab.run.store import read_checkpoint

    out = tmp_path / "ckpt"
    assert main(["import-hf", str(gpt2_dir), "--out", str(out)]) == 0
    ckpt = read_checkpoint(out)
    assert ckpt.config.train.dtype == "fp32"
    assert eval_dtype(EvalOptions(str(out)), ckpt) == "fp32"
    assert eval_dtype(EvalOptions(str(out), dtype="bf16"), ckpt) == "bf16"
    # an import written before train.dtype was recorded as fp32 is still recognised
    ckpt.config.train.dtype = "bf16"
    assert eval_dtype(EvalOptions(str(out)), ckpt) == "fp32"

    capsys.readouterr()
    assert main(["eval", str(out), "--data", str(data_dir), "--windows", "8"]) == 0
    printed = float(re.search(r"val loss (\d+\.\d+)", capsys.readouterr().out).group(1))
    x, y = TokenData(data_dir).val_windows(8, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gpt2_dir),
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=x).logits
    expected = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    assert printed == pytest.approx(expected, abs=1.5e-4)  # the 4 printed decimals agree
