"""What the tools take from a run: its model, its data, its tokenizer.

`load_model` reads a checkpoint into a GPT; `open_data` opens (or prepares) the run's data and
`check_vocab` checks the model covers it; the tokenizer is copied into the run when training
starts (`copy_tokenizer`), found again from a checkpoint (`find_tokenizer_dir`,
`run_tokenizer`) and carried along to checkpoints derived from a run (`tokenizer_to_carry`,
`carry_tokenizer`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from qkvlab.data.loader import TokenData
from qkvlab.data.prepare import prepare
from qkvlab.data.tokenizer import Tokenizer, load_tokenizer, read_tokenizer_meta
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import read_tree_inside, write_bytes_atomic, write_text_atomic
from qkvlab.model import GPT
from qkvlab.run.checkpoint import Checkpoint, load_model_state
from qkvlab.run.config import EMBEDDED_SOURCE, DataConfig, RunConfig
from qkvlab.run.layout import TOKENIZER_DIR, TOKENIZER_META
from qkvlab.run.store import read_checkpoint

# what import-hf records: state.json "kind" of an imported checkpoint, and the tokenizer
# spec of one imported without a tokenizer qkvlab can use
IMPORTED_KIND = "imported"
NO_TOKENIZER = "unknown"


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Checkpoint]:
    """(model in eval mode on `device`, checkpoint) from a run folder or checkpoint folder."""
    ckpt = read_checkpoint(path)
    model = GPT(ckpt.config.model)
    load_model_state(model, ckpt)
    model.to(device)
    model.eval()
    return model, ckpt


def open_data(dc: DataConfig, log=print) -> TokenData:
    """The run's prepared data; the embedded corpus is prepared on first use."""
    data_dir = Path(dc.dir)
    if not (data_dir / "meta.json").is_file():
        if dc.prepare_if_missing and dc.source == EMBEDDED_SOURCE:
            log(f"preparing {dc.source} with the {dc.tokenizer} tokenizer into {data_dir}")
            prepare(dc.source, dc.tokenizer, data_dir)
        else:
            raise QkvlabError(f"no prepared data at {data_dir}: run `{dc.prepare_hint()}`")
    data = TokenData(data_dir)
    if data.meta.get("tokenizer") != dc.tokenizer:
        raise QkvlabError(
            f"data dir {data_dir} was prepared with tokenizer {data.meta.get('tokenizer')} but "
            f"the config says data.tokenizer = {dc.tokenizer}: fix data.tokenizer or data.dir"
        )
    return data


def check_vocab(cfg: RunConfig, data: TokenData) -> None:
    """The model's vocabulary must cover every id of the data (padding above it is fine)."""
    if cfg.model.vocab_size < data.vocab_size:
        raise QkvlabError(
            f"model.vocab_size = {cfg.model.vocab_size} is smaller than the vocabulary of the "
            f"data in {data.data_dir} ({data.vocab_size} tokens, tokenizer "
            f"{data.meta.get('tokenizer')}): use --set model.vocab_size={data.vocab_size} "
            "(or larger, e.g. padded to a multiple of 64)"
        )


# ---- the tokenizer ------------------------------------------------------------------------
def copy_tokenizer(data: TokenData, run_dir: Path) -> None:
    """Copy meta.json and the tokenizer tables into the run, so sampling needs no data dir."""
    dest = run_dir / TOKENIZER_DIR
    dest.mkdir(exist_ok=True)
    names = [TOKENIZER_META, *data.meta.get("tokenizer_files", [])]
    for name in names:
        src = data.data_dir / name
        if src.is_file():
            write_text_atomic(dest / name, src.read_text(encoding="utf-8"))


def find_tokenizer_dir(ckpt: Any) -> Path | None:
    """The folder with a checkpoint's tokenizer meta.json: its run's copy, one next to the
    checkpoint, else the data dir it was trained on; None when there is none."""
    for folder in (ckpt.run_dir / TOKENIZER_DIR, ckpt.path / TOKENIZER_DIR,
                   Path(ckpt.config.data.dir)):
        if (folder / TOKENIZER_META).is_file():
            return folder
    return None


def run_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The tokenizer a run trained with: its own copy, else the data dir's."""
    folder = find_tokenizer_dir(ckpt)
    if folder is not None:
        return load_tokenizer(folder)
    if ckpt.config.data.tokenizer == NO_TOKENIZER:
        raise QkvlabError(
            f"{ckpt.path} has no tokenizer (it was imported without one): put the model's "
            "tokenizer files (tokenizer.json, or vocab.json and merges.txt) into the "
            "transformers folder and run `qkvlab import-hf` on it again")
    raise QkvlabError(
        f"cannot find the tokenizer of {ckpt.path} (no {TOKENIZER_DIR}/ in its run and no data "
        f"at {ckpt.config.data.dir}): run `{ckpt.config.data.prepare_hint()}`"
    )


def tokenizer_to_carry(ckpt: Checkpoint) -> dict[str, bytes]:
    """The run's tokenizer files, for a checkpoint derived from it (converted, retrofitted);
    read before that checkpoint is written, so a link out of the run is refused first."""
    src_tok = ckpt.run_dir / TOKENIZER_DIR
    return read_tree_inside(ckpt.run_dir, src_tok) if src_tok.is_dir() else {}


def carry_tokenizer(files: dict[str, bytes], dest: Path) -> None:
    """Put the files of `tokenizer_to_carry` next to the derived checkpoint `dest`, where
    sampling looks for them; a tokenizer already there is kept."""
    if files and not (dest / TOKENIZER_DIR).exists():
        for name, data in files.items():
            write_bytes_atomic(dest / TOKENIZER_DIR / name, data)


def read_data_meta(data_dir: Path) -> dict[str, Any]:
    """meta.json of the folder a user passed as --data, checked; it must name its tokenizer."""
    fix = "make one with `qkvlab prepare`"
    meta = None
    if (data_dir / "meta.json").is_file():
        meta = read_tokenizer_meta(data_dir, fix)
    if meta is None or "tokenizer" not in meta:
        raise QkvlabError(f"--data {data_dir} is not a prepared data folder (no readable "
                          f"meta.json naming its tokenizer): {fix}")
    return meta


def data_config(ckpt: Any, data_dir: str | Path | None) -> DataConfig:
    """The data to evaluate (or heal) a checkpoint on: its run's, or the prepared folder
    `data_dir`. An imported checkpoint without a tokenizer takes `data_dir`'s tokenizer (it has
    none to compare it with); one without prepared data is told how to name some."""
    dc = ckpt.config.data
    imported = ckpt.state.get("kind") == IMPORTED_KIND
    if data_dir:
        if dc.tokenizer != NO_TOKENIZER:
            return dataclasses.replace(dc, dir=str(data_dir))
        meta = read_data_meta(Path(data_dir))
        return DataConfig(dir=str(data_dir), source=str(meta.get("source") or "unknown"),
                          tokenizer=meta["tokenizer"], prepare_if_missing=False)
    if imported and not (Path(dc.dir) / "meta.json").is_file():
        why = ("the import found no tokenizer qkvlab can use, so " if dc.tokenizer ==
               NO_TOKENIZER else "")
        raise QkvlabError(
            f"{ckpt.path} is an imported model and {why}there is no prepared data at {dc.dir}: "
            "pass --data DIR, a folder made by `qkvlab prepare TEXT --tokenizer SPEC --out DIR` "
            "with the tokenizer the model was trained with (its vocabulary must fit the "
            f"model's {ckpt.config.model.vocab_size} tokens)")
    return dc
