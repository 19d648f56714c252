"""`qkvlab import-hf MODEL_DIR`: a local transformers model of the GPT-2 (GPT2LMHeadModel) or
Llama (LlamaForCausalLM) architecture -> a qkvlab checkpoint folder (safetensors + JSON) that
`qkvlab eval`, `sample`, `convert`, `retrofit` and `export` read.

Only config.json and safetensors weights are read (json and safetensors: nothing is executed or
unpickled). A directory with pytorch_model.bin only is refused with the conversion to do. The
checkpoint is written to a temporary sibling folder and renamed into place only once its logits
match transformers' (when transformers is installed), so a refused import leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from qkvlab.data.cache import cache_dir
from qkvlab.data.prepare import default_data_dir
from qkvlab.data.tokenizer import (
    BPE_FILE,
    GPT2_ENCODER,
    GPT2_VOCAB_BPE,
    BPETokenizer,
    read_tokenizer_meta,
)
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import check_tree, read_inside
from qkvlab.hf.export import (
    CONFIG_FILE,
    GPT2_ARCH,
    QKVLAB_TOKENIZER_DIR,
    WEIGHTS_FILE,
    transformers_available,
    verified_logit_diff,
)
from qkvlab.hf.gpt2 import (
    COMMON_FIELD_TYPES,
    QKVLAB_KEY,
    check_field_types,
    check_gpt2_config,
    from_gpt2,
)
from qkvlab.hf.llama import LLAMA_ARCH, check_llama_config, from_llama
from qkvlab.jsonfile import check_fields, read_json_object
from qkvlab.model.config import from_table
from qkvlab.model.gpt import GPT
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.config import DataConfig, RunConfig, TrainConfig
from qkvlab.run.layout import TOKENIZER_DIR, checkpoint_out_dir
from qkvlab.run.load import IMPORTED_KIND, NO_TOKENIZER, load_model, read_data_meta

INDEX_FILE = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
OTHER_FORMATS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index")
GPT2_VOCAB = 50257
GPT2_EOT = 50256
CONVERT_HINT = ("load it with transformers once and save it with "
                "model.save_pretrained(DIR, safe_serialization=True)")


# config.json fields read here beyond the architecture's own (gpt2.py, llama.py check those),
# and those of the entry a qkvlab export adds, by kind (qkvlab.jsonfile.KINDS)
CONFIG_FIELDS = {"model_type": "str?", QKVLAB_KEY: "object?"}
QKVLAB_FIELDS = {"data": "object?", "step": "index?"}
CONFIG_FIX = "fix config.json, or save the model again with transformers"


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a model directory (checked to be a GPT-2 qkvlab can reproduce)."""
    if not model_dir.exists():
        raise QkvlabError(f"{model_dir} does not exist: give a local transformers model folder "
                          "(there is no hub access here)")
    if not model_dir.is_dir():
        raise QkvlabError(f"{model_dir} is a file: give the model folder (config.json + "
                          "model.safetensors)")
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise QkvlabError(f"no {CONFIG_FILE} in {model_dir}: not a transformers model folder")
    config = read_json_object(path, CONFIG_FIELDS, fix=CONFIG_FIX)
    check_fields(config.get(QKVLAB_KEY) or {}, QKVLAB_FIELDS, f"{path}: {QKVLAB_KEY}",
                 CONFIG_FIX)
    check_config(config)
    return config


def check_config(config: dict[str, Any]) -> str:
    """The transformers class of a config.json qkvlab can reproduce exactly (GPT2LMHeadModel or
    LlamaForCausalLM), or a one-line error naming the field it cannot."""
    model_type = config.get("model_type")
    if model_type == "llama":
        if "hidden_size" not in config and "n_embd" in config:
            raise QkvlabError("config.json has model_type='llama' but GPT-2's fields (n_embd, "
                              "n_layer, n_head) instead of Llama's (hidden_size, ...): fix "
                              "model_type, or the fields")
        check_field_types(config, COMMON_FIELD_TYPES)
        check_llama_config(config)
        return LLAMA_ARCH
    check_gpt2_config(config)  # refuses any other model_type, naming both that import takes
    return GPT2_ARCH


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise QkvlabError(f"{path} is not a readable safetensors file ({exc})") from None


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors (or of the shards its index names); never a pickle."""
    single, index = model_dir / WEIGHTS_FILE, model_dir / INDEX_FILE
    if single.is_file():
        return _load(single)
    if index.is_file():
        fix = f"not a safetensors index; {CONVERT_HINT}"
        weight_map = read_json_object(index, {"weight_map": "object"}, fix=fix).get("weight_map")
        if not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise QkvlabError(f"{index} has no weight_map of tensor names to shard files: {fix}")
        shards = sorted(set(weight_map.values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            shard_path = model_dir / shard
            if "/" in shard or "\\" in shard or not shard_path.is_file():
                raise QkvlabError(f"{index} names shard {shard!r}, which is missing")
            tensors.update(_load(shard_path))
        return tensors
    pickles = sorted(p.name for p in model_dir.iterdir()
                     if p.name in PICKLE_NAMES or p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise QkvlabError(f"{model_dir} has only {', '.join(pickles)} (pickle): qkvlab never "
                          f"unpickles files; convert to safetensors first: {CONVERT_HINT}")
    others = sorted(p.name for p in model_dir.iterdir() if p.name in OTHER_FORMATS)
    if others:
        raise QkvlabError(f"{model_dir} has only {', '.join(others)}: qkvlab reads PyTorch "
                          f"safetensors weights; {CONVERT_HINT}")
    raise QkvlabError(f"no {WEIGHTS_FILE} in {model_dir}: the weights are missing")


@dataclass
class TokenizerImport:
    """The qkvlab tokenizer folder to write (meta.json + tables), or nothing, and why."""

    spec: str | None = None
    vocab_size: int | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    note: str = ""


def _cached_gpt2_tables() -> tuple[dict[str, int], list[str]] | None:
    """GPT-2's encoder.json and merges from qkvlab's cache, without any download."""
    enc, bpe = cache_dir() / GPT2_ENCODER.dest_name, cache_dir() / GPT2_VOCAB_BPE.dest_name
    if not (enc.is_file() and bpe.is_file()):
        return None
    merges = [m for m in bpe.read_text(encoding="utf-8").splitlines()[1:] if m]
    return json.loads(enc.read_text(encoding="utf-8")), merges


def copy_bound(model_dir: Path) -> Path:
    """The folder whose files import-hf may copy from: the model folder, or for a snapshot of
    the Hugging Face hub cache (models--ORG--NAME/snapshots/REV, whose files are links into
    ../../blobs) the cached repository, since its blobs are the snapshot's own files."""
    snapshots = model_dir.resolve().parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        return snapshots.parent
    return model_dir


def detect_tokenizer(model_dir: Path) -> TokenizerImport:
    """Recognise the model directory's tokenizer as one of qkvlab's (gpt2, bpe:N, or a qkvlab
    export's own tables)."""
    out = TokenizerImport()
    ours = model_dir / QKVLAB_TOKENIZER_DIR
    if (ours / "meta.json").is_file():
        meta = read_tokenizer_meta(ours, f"export the model again, or remove "
                                          f"{QKVLAB_TOKENIZER_DIR}/ to import it without")
        out.spec, out.vocab_size = meta.get("tokenizer"), meta.get("vocab_size")
        check_tree(ours, copy_bound(model_dir))  # copied into the checkpoint: never a link's target
        out.files = {p.name: p.read_bytes() for p in ours.iterdir() if p.is_file()}
        out.note = f"qkvlab {out.spec} tokenizer (from {QKVLAB_TOKENIZER_DIR}/)"
        return out
    vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
    if vocab.is_file() and merges.is_file():
        table = read_json_object(vocab, fix="it must map each token to its id")
        try:
            merge_lines = [m for m in merges.read_text(encoding="utf-8").splitlines()
                           if m and not m.startswith("#version")]
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise QkvlabError(f"cannot read the tokenizer files of {model_dir} ({exc})") from None
        out.vocab_size = len(table)
        looks_gpt2 = len(table) == GPT2_VOCAB and table.get("<|endoftext|>") == GPT2_EOT
        cached = _cached_gpt2_tables() if looks_gpt2 else None
        if looks_gpt2 and (cached is None or (cached[0] == table and cached[1] == merge_lines)):
            out.spec = "gpt2"
            out.files = {"meta.json": json.dumps({"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB,
                                                  "eot_token": GPT2_EOT}).encode()}
            out.note = ("GPT-2's tokenizer (vocab.json + merges.txt " +
                        ("identical to GPT-2's)" if cached else "of GPT-2's size and "
                         "end-of-text id; GPT-2's tables are not cached to compare)"))
        else:
            out.note = (f"vocab.json/merges.txt ({len(table)} tokens) are not GPT-2's: no qkvlab "
                        "tokenizer; sample/eval need data prepared with the model's tokenizer")
        return out
    tok_json = model_dir / "tokenizer.json"
    if tok_json.is_file():
        try:
            size = HFTokenizer.from_file(str(tok_json)).get_vocab_size()
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise QkvlabError(f"{tok_json} is not a readable tokenizer.json ({exc})") from None
        out.vocab_size = size
        if size >= 257:
            spec = f"bpe:{size}"
            BPETokenizer.load(model_dir, spec)  # fails (one line) if qkvlab cannot use it
            out.spec = spec
            out.files = {BPE_FILE: read_inside(copy_bound(model_dir), tok_json),
                         "meta.json": json.dumps({"tokenizer": spec, "vocab_size": size}).encode()}
            out.note = f"tokenizer.json as qkvlab's {spec}"
        else:
            out.note = f"tokenizer.json has {size} tokens: not usable as qkvlab bpe:N"
        return out
    out.note = "no tokenizer files: sample/eval need data prepared with the model's tokenizer"
    return out


@dataclass
class ImportResult:
    out: Path
    model: GPT
    notes: list[str]
    tokenizer_note: str
    max_logit_diff: float | None
    architecture: str = GPT2_ARCH


def _data_config(config: dict[str, Any], tok: TokenizerImport, data_dir: str | None,
                 name: str) -> Any:
    if data_dir:
        meta = read_data_meta(Path(data_dir))
        return DataConfig(dir=str(data_dir), source=str(meta.get("source", "unknown")),
                          tokenizer=str(meta.get("tokenizer")), prepare_if_missing=False), meta
    recorded = (config.get(QKVLAB_KEY) or {}).get("data")
    if isinstance(recorded, dict):
        try:
            return from_table(DataConfig, recorded, "data"), None  # typed, as a config file
        except (TypeError, QkvlabError):
            pass  # an export from another qkvlab version: fall through
    if tok.spec in ("gpt2", "bytes"):
        # fixed vocabularies: the embedded corpus prepared with it is a valid eval set
        return DataConfig(dir=str(default_data_dir("shakespeare", tok.spec)),
                          source="shakespeare", tokenizer=tok.spec), None
    return DataConfig(dir=f"data/{name}", source=name, tokenizer=tok.spec or NO_TOKENIZER,
                      prepare_if_missing=False), None


def _llama_notes(model: GPT, tensors: dict[str, torch.Tensor], detect: bool) -> list[str]:
    notes = []
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    if dtypes != ["float32"]:
        notes.append(f"weights stored as {', '.join(dtypes)}: upcast to float32")
    cfg = model.cfg
    if cfg.projection != "baseline":
        r = cfg.alpha
        proj = "q_proj" if cfg.projection == "q-identity" else "k_proj"
        notes.append(f"every layer's {proj} is {r:g} I: imported as projection={cfg.projection}")
    elif detect:
        notes.append("no layer's q_proj or k_proj is a multiple of I: imported as "
                     "projection=baseline")
    return notes


def _move_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished folder `tmp` to `dest`, replacing an old checkpoint there (put back
    if the rename fails)."""
    old = None
    if dest.exists():
        old = dest.parent / f".old-import-{dest.name}-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if old is not None and not dest.exists():
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def import_model_dir(model_dir: str | Path, out: str | Path | None = None, *,
                     detect: bool = True, data_dir: str | None = None,
                     verify: bool = True) -> ImportResult:
    """Read a GPT-2 or Llama transformers folder, write a qkvlab checkpoint folder whose logits
    were verified against transformers (when installed): a difference beyond float32 rounding
    is refused and nothing is written."""
    model_dir = Path(model_dir).expanduser()
    config = read_config(model_dir)
    arch = check_config(config)
    tensors = read_weights(model_dir)
    if arch == LLAMA_ARCH:
        model = from_llama(config, tensors, detect=detect)
        notes = _llama_notes(model, tensors, detect)
    else:
        model, notes = from_gpt2(config, tensors, detect=detect)
    del tensors
    tok = detect_tokenizer(model_dir)
    V = model.cfg.vocab_size
    if tok.vocab_size is not None and tok.vocab_size > V:
        raise QkvlabError(f"mismatched vocabularies: the tokenizer in {model_dir} has "
                          f"{tok.vocab_size} tokens but the model only {V}")
    name = model_dir.resolve().name or "model"
    data_cfg, data_meta = _data_config(config, tok, data_dir, f"hf-{name}")
    if data_meta is not None and data_meta.get("vocab_size", 0) > V:
        raise QkvlabError(f"mismatched vocabularies: --data {data_dir} has "
                          f"{data_meta.get('vocab_size')} tokens but the model only {V}")
    dest = checkpoint_out_dir(out, Path("runs") / f"hf-{name}", model_dir,
                              "the model folder itself")
    # an imported model is evaluated as transformers computes it, in float32 (bf16 autocast
    # would move its loss in the 4th decimal)
    run_cfg = RunConfig(model=model.cfg, data=data_cfg, train=TrainConfig(dtype="fp32"),
                        name=f"hf-{name}", out_dir=str(dest))
    step = (config.get(QKVLAB_KEY) or {}).get("step", 0)  # a qkvlab export keeps its step
    state = {"step": step if isinstance(step, int) else 0, "kind": IMPORTED_KIND,
             "imported_from": str(model_dir), "architecture": arch,
             "import_notes": notes}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-import-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    diff = None
    try:
        write_checkpoint(tmp, model.state_dict(), run_cfg, state=state)
        if tok.files:
            (tmp / TOKENIZER_DIR).mkdir()
            for fname, data in tok.files.items():
                (tmp / TOKENIZER_DIR / fname).write_bytes(data)
        if verify and transformers_available():
            # compare what was written, read back, not the model in memory
            written, _ = load_model(tmp)
            diff = verified_logit_diff(written, model_dir, f"import of {model_dir}")
        _move_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ImportResult(dest, model, notes, tok.note, diff, arch)
