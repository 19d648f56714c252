"""`qkvlab export CHECKPOINT --format hf OUT_DIR`: a transformers model directory.

The directory holds config.json (LlamaForCausalLM for a Llama-style model: RMSNorm, RoPE and a
SwiGLU MLP; GPT2LMHeadModel otherwise), model.safetensors, the tokenizer files where
Hugging Face has a matching tokenizer (gpt2: vocab.json + merges.txt; bpe:N: tokenizer.json), and
qkvlab_tokenizer/ (qkvlab's own tokenizer tables, so `qkvlab import-hf` restores sampling for
char/bytes models too). `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it with no custom
code; when transformers is installed the export is verified by comparing logits, and an export
whose logits differ is not written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qkvlab.data.cache import fetch_file
from qkvlab.data.tokenizer import (
    BPE_FILE,
    GPT2_ENCODER,
    GPT2_VOCAB_BPE,
    TOKENIZER_FILES,
    read_tokenizer_meta,
)
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import check_tree, follow_umask
from qkvlab.hf.gpt2 import QKVLAB_KEY, export_problem, to_gpt2
from qkvlab.hf.llama import LLAMA_ARCH, is_llama_style, llama_problem, to_llama
from qkvlab.jsonfile import read_json_object
from qkvlab.model.gpt import GPT
from qkvlab.run.layout import TOKENIZER_DIR
from qkvlab.run.load import find_tokenizer_dir, load_model

FORMATS = ("hf",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
QKVLAB_TOKENIZER_DIR = "qkvlab_tokenizer"
ENDOFTEXT = "<|endoftext|>"
VERIFY_TOL = 1e-4  # float32 max |logit diff| above which an export or import is wrong
# ... or this fraction of the largest |logit|, whichever is larger: float32 rounding grows with
# the logits' size (a real GPT-2's reach 100), a mapping error shows up at order one
VERIFY_RTOL = 1e-5
GPT2_ARCH = "GPT2LMHeadModel"
# every name an export writes at its top level (the tokenizer files where the tokenizer has
# them), and in qkvlab_tokenizer/: what a re-export may replace
HF_TOKENIZER_NAMES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json")
EXPORT_NAMES = frozenset({WEIGHTS_FILE, CONFIG_FILE, *HF_TOKENIZER_NAMES})
QKVLAB_TOKENIZER_NAMES = frozenset({"meta.json", *TOKENIZER_FILES})


@dataclass
class TokenizerExport:
    """Files to write for the tokenizer, and what happened, in words."""

    files: dict[str, bytes] = field(default_factory=dict)
    qkvlab_files: dict[str, bytes] = field(default_factory=dict)  # into qkvlab_tokenizer/
    spec: str | None = None
    vocab_size: int | None = None
    eot_token: int | None = None
    note: str = ""


def tokenizer_export(ckpt: Any, block_size: int) -> TokenizerExport:
    """The Hugging Face tokenizer files of a checkpoint's tokenizer, where one exists."""
    out = TokenizerExport()
    folder = find_tokenizer_dir(ckpt)
    if folder is None:
        out.note = ("no tokenizer found (no tokenizer/ in the run, no data at "
                    f"{ckpt.config.data.dir}): tokenizer files skipped")
        return out
    # its files are copied into the export: a run's (or checkpoint's) tokenizer/ is that
    # folder's own, a data dir's files are the data dir's
    owner = folder.parent if folder.name == TOKENIZER_DIR else folder
    check_tree(folder, owner)
    meta = read_tokenizer_meta(folder)
    spec = meta.get("tokenizer", "")
    out.spec, out.vocab_size = spec, meta.get("vocab_size")
    out.eot_token = meta.get("eot_token")
    keep = {"tokenizer": spec, "vocab_size": out.vocab_size, "eot_token": out.eot_token}
    out.qkvlab_files["meta.json"] = (json.dumps(keep, indent=1) + "\n").encode()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            out.qkvlab_files[name] = (folder / name).read_bytes()
    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    if spec == "gpt2":
        try:
            out.files["vocab.json"] = fetch_file(GPT2_ENCODER).read_bytes()
            out.files["merges.txt"] = fetch_file(GPT2_VOCAB_BPE).read_bytes()
        except QkvlabError as exc:
            out.note = f"GPT-2 tokenizer files unavailable ({exc}): tokenizer files skipped"
            return out
        tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
                   "model_max_length": block_size, **special}
        out.eot_token = 50256
        out.note = "gpt2 tokenizer: vocab.json + merges.txt (GPT2Tokenizer)"
    elif spec.startswith("bpe:") and (folder / BPE_FILE).is_file():
        out.files["tokenizer.json"] = (folder / BPE_FILE).read_bytes()
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size}
        if out.eot_token is not None:
            tok_cfg.update(special)
        out.note = f"{spec} tokenizer: tokenizer.json (PreTrainedTokenizerFast)"
    else:
        out.note = (f"the {spec} tokenizer has no standard Hugging Face equivalent: no HF "
                    f"tokenizer files (qkvlab's own tables are in {QKVLAB_TOKENIZER_DIR}/)")
        return out
    out.files["tokenizer_config.json"] = (json.dumps(tok_cfg, indent=1) + "\n").encode()
    if "bos_token" in tok_cfg:
        out.files["special_tokens_map.json"] = (json.dumps(special, indent=1) + "\n").encode()
    return out


def _check_out_dir(out: Path, source: Path) -> None:
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise QkvlabError(f"OUT_DIR {out} is inside the source checkpoint: choose another folder")
    if out.exists():
        if not out.is_dir():
            raise QkvlabError(f"OUT_DIR {out} exists and is a file: choose a new folder")
        previous = out / CONFIG_FILE
        is_ours = False
        if previous.is_file():
            try:
                is_ours = QKVLAB_KEY in read_json_object(previous, fix="")
            except QkvlabError:  # not a config.json qkvlab wrote
                is_ours = False
        if any(out.iterdir()) and not is_ours:
            # the folder is replaced as a whole: never replace someone else's
            raise QkvlabError(f"OUT_DIR {out} exists, is not empty and is not a qkvlab export: "
                              "choose a new folder")
        added = _not_exported(out)
        if added:  # ... nor what was added to an earlier export
            shown = ", ".join(added[:4]) + (f" and {len(added) - 4} more" if len(added) > 4
                                            else "")
            raise QkvlabError(f"OUT_DIR {out} is an earlier export that also holds {shown}, "
                              "which qkvlab did not write and a new export would delete: move "
                              "them out, or choose a new folder")


def _not_exported(out: Path) -> list[str]:
    """What is in an export folder that no export writes (sorted; a folder ends in /)."""
    found = []
    for entry in sorted(out.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and entry.name == QKVLAB_TOKENIZER_DIR:
            found += [f"{entry.name}/{e.name}" + ("/" if e.is_dir() else "")
                      for e in sorted(entry.iterdir())
                      if e.name not in QKVLAB_TOKENIZER_NAMES or not e.is_file()]
        elif entry.name not in EXPORT_NAMES or not entry.is_file() or entry.is_symlink():
            found.append(entry.name + ("/" if entry.is_dir() else ""))
    return found


def write_model_dir(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                    files: dict[str, bytes] | None = None,
                    subdirs: dict[str, dict[str, bytes]] | None = None,
                    check: Callable[[Path], None] | None = None) -> Path:
    """Write a model directory atomically (a temp sibling renamed into place). `check` runs on
    the complete temp folder first: when it raises, nothing is left behind and an earlier
    folder at `out` is kept."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-hf-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        follow_umask(tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        for sub, sub_files in (subdirs or {}).items():
            if sub_files:
                (tmp / sub).mkdir()
                for name, data in sub_files.items():
                    (tmp / sub / name).write_bytes(data)
        if check is not None:
            check(tmp)
        old = None
        if out.exists():
            old = out.parent / f".old-hf-{out.name}-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    """transformers' AutoModelForCausalLM of `model_dir` in float32 eval mode, quietly."""
    # transformers is the optional `hf` extra (and takes seconds to import)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars would clutter the summary
    try:
        # use_safetensors: never fall back to a pytorch_model.bin there (a pickle)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), use_safetensors=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return model.float().eval()


@torch.no_grad()
def hf_logit_check(model: GPT, model_dir: Path, *, seed: int = 0, batch: int = 2,
                   length: int = 32) -> tuple[float, float]:
    """(max |logits| difference, the largest |logit|) between `model` and transformers' load
    of `model_dir`, both in float32 eval mode on the CPU, on random token ids. Needs
    transformers; a folder it cannot load or run is a one-line error."""
    try:
        hf = load_hf_model(model_dir)
    except Exception as exc:  # transformers raises many types on a folder it rejects
        raise QkvlabError(f"transformers could not load the model to compare logits "
                          f"({_first_line(exc)})") from None
    ours = model.float().eval().cpu()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(model.cfg.vocab_size, (batch, min(length, model.cfg.block_size)),
                        generator=gen)
    a = ours(idx)[0]
    try:
        b = hf(input_ids=idx).logits.float()
    except Exception as exc:
        raise QkvlabError(f"transformers could not run the model to compare logits "
                          f"({_first_line(exc)})") from None
    if a.shape != b.shape:
        raise QkvlabError(f"transformers computes logits of shape {list(b.shape)}, qkvlab "
                          f"{list(a.shape)}: the two models differ")
    diff = (a - b).abs().max()
    return (float(diff) if bool(torch.isfinite(diff)) else math.inf), float(b.abs().max())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def hf_logit_diff(model: GPT, model_dir: Path, **kw: Any) -> float:
    """max |logits| difference between `model` and transformers' load of `model_dir`."""
    return hf_logit_check(model, model_dir, **kw)[0]


def logit_tolerance(largest: float) -> float:
    """The largest max |logit diff| that float32 rounding explains for logits this large."""
    return max(VERIFY_TOL, VERIFY_RTOL * largest)


def verified_logit_diff(model: GPT, model_dir: Path, what: str) -> float:
    """hf_logit_check, refused (one line) when the difference is more than rounding."""
    diff, largest = hf_logit_check(model, model_dir)
    tol = logit_tolerance(largest)
    if not diff <= tol:
        raise QkvlabError(f"{what}: transformers computes different logits (max |logit diff| "
                          f"{diff:.3g} > {tol:.1g}), so nothing was written; this is a bug "
                          "in the mapping or a model qkvlab does not reproduce")
    return diff


@dataclass
class ExportResult:
    out: Path
    files: list[str]
    tokenizer_note: str
    scheme_note: str
    max_logit_diff: float | None  # None: transformers not installed, not verified
    architecture: str = GPT2_ARCH  # the transformers class written: GPT2LMHeadModel or Llama


def scheme_note(model: GPT, architecture: str = GPT2_ARCH) -> str:
    """How the model's projection scheme was written into GPT-2's c_attn block (or Llama's
    q/k/v_proj)."""
    cfg = model.cfg
    r = cfg.alpha
    llama = architecture == LLAMA_ARCH
    q, k, v = (("q_proj", "k_proj", "v_proj") if llama
               else ("the query block", "the key block", "the value block"))
    ratio = "" if r == 1.0 else f" (scale ratio s*sqrt(d_k) = {r:g} folded into {q})"
    text = {
        "baseline": f"W_Q, W_K, W_V written as they are{ratio}",
        "q-identity": f"W_Q = I written as {r:g} I in {q}",
        "k-identity": f"W_K = I written as {r:g} I in {k}",
        "v-identity": f"W_V = I written as I in {v}{ratio}",
    }[cfg.projection]
    if cfg.learned_scale:
        carrier = k if cfg.projection == "k-identity" else q
        text += f"; the learned per-head logit gains folded into {carrier}"
    if cfg.kv_heads != cfg.n_head:
        text += (f"; {cfg.kv_heads} key/value heads as num_key_value_heads" if llama
                 else f"; {cfg.kv_heads} key/value heads repeated to {cfg.n_head}")
    if cfg.share_layers:
        text += f"; the shared block written {cfg.n_layer} times"
    if cfg.positions == "none":
        text += "; positions=none written as a zero position table"
    return text


def export_architecture(model: GPT) -> str:
    """The transformers class that holds `model` exactly: Llama for a Llama-style model (RMSNorm,
    RoPE, SwiGLU), GPT-2 otherwise; one line with both reasons when neither can."""
    cfg = model.cfg
    if is_llama_style(cfg):
        problem = llama_problem(cfg)
        if problem is None:
            return LLAMA_ARCH
    elif export_problem(cfg) is None:
        return GPT2_ARCH
    reasons = f"{export_problem(cfg)}; {llama_problem(cfg)}"
    raise QkvlabError(f"cannot export: {reasons}; no exact export exists (train with a GPT-2- or "
                      "Llama-compatible config, see docs/hf.md)")


def export_checkpoint(path: str | Path, out: str | Path, *, fmt: str = "hf",
                      dtype: str = "float32", verify: bool = True) -> ExportResult:
    """Export a qkvlab checkpoint (run or checkpoint folder) as a transformers folder: a
    LlamaForCausalLM for a Llama-style model, a GPT2LMHeadModel otherwise."""
    if fmt not in FORMATS:
        raise QkvlabError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise QkvlabError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model, ckpt = load_model(path, "cpu")
    arch = export_architecture(model)
    out = Path(out).expanduser()
    _check_out_dir(out, ckpt.path)
    tok = tokenizer_export(ckpt, model.cfg.block_size)
    if tok.vocab_size is not None and tok.vocab_size > model.cfg.vocab_size:
        raise QkvlabError(f"mismatched vocabularies: the {tok.spec} tokenizer has "
                          f"{tok.vocab_size} tokens but the model only {model.cfg.vocab_size}")
    model = model.to(DTYPES[dtype])
    extra = {"source": str(ckpt.path), "step": ckpt.step, "data": ckpt.config.to_dict()["data"],
             "tokenizer": tok.spec}
    to_hf = to_llama if arch == LLAMA_ARCH else to_gpt2
    config, tensors = to_hf(model, eot_token=tok.eot_token, extra=extra)
    diffs: list[float] = []

    def check(folder: Path) -> None:
        if dtype == "float32":
            diffs.append(verified_logit_diff(model, folder, f"export to {out}"))
        else:
            # factors folded into a weight (the scale ratio, learned gains) are rounded to
            # bf16/fp16 after folding, qkvlab's own weights before: the two differ at that
            # precision, so only the float32 export is held to float32 rounding
            diffs.append(hf_logit_diff(model, folder))

    verify = verify and transformers_available()
    write_model_dir(out, config, tensors, tok.files, {QKVLAB_TOKENIZER_DIR: tok.qkvlab_files},
                    check=check if verify else None)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return ExportResult(out, files, tok.note, scheme_note(model, arch),
                        diffs[0] if diffs else None, arch)
