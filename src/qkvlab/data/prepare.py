"""`qkvlab prepare`: tokenise a source into train.bin / val.bin / meta.json.

The .bin files are raw little-endian token arrays (uint16 when the vocabulary fits, else uint32),
the layout nanoGPT uses, so they can be memory-mapped without parsing. Every file is written to a
temporary name and renamed into place, and meta.json is written last: a dir with meta.json is
complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qkvlab.data.corpus import (
    hf_fingerprint,
    load_hf_dataset,
    read_source_parts,
    source_kind,
    source_name,
)
from qkvlab.data.tokenizer import (
    TOKENIZER_FILES,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    parse_spec,
)
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import temp_sibling, write_bytes_atomic
from qkvlab.jsonfile import read_json_object

FORMAT = 1
SPLIT_SEED = 2357  # nanoGPT's OpenWebText split seed, reused for every document split
DEFAULT_VAL_FRACTION = 0.1
HF_VAL_FRACTION = 0.0005  # nanoGPT's OpenWebText val share; 10% of a web corpus is wasteful
ENCODE_BATCH_DOCS = 1024
MAX_SHARDS = 1024
# meta.json's record of which tokens of each split come from which part of a named corpus:
# {"train": [[part, first, end], ...], "val": [...]}, token offsets into train.bin / val.bin.
# Folders prepared before it was recorded lack it (and get it when prepared again).
SOURCE_SPANS = "source_spans"
# Settings that must match for an existing prepared dir to be reused as it is.
_SETTINGS = ("format", "tokenizer", "source_sha256", "val_fraction", "split_seed")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype holding ids 0..vocab_size-1 (uint16 or uint32)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def default_data_dir(source: str, tokenizer: str) -> Path:
    """data/<source-name>-<tokenizer> under the current directory, e.g. data/shakespeare-char."""
    return Path("data") / f"{source_name(source)}-{tokenizer.replace(':', '-')}"


def write_tokens(
    path: Path, chunks: Iterable[Sequence[int] | np.ndarray], total: int, dtype: np.dtype
) -> int:
    """Write `total` token ids, arriving in `chunks`, to `path` through a memmap; atomically.

    Only one chunk is in memory at a time, so shards of a large dataset can stream through.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    limit = np.iinfo(dtype).max
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    open(tmp, "xb").close()
    try:
        # np.memmap cannot map an empty file; an empty split is written as an empty file.
        out = np.memmap(tmp, dtype=dtype, mode="w+", shape=(total,)) if total else None
        pos = 0
        for chunk in chunks:
            arr = np.asarray(chunk, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                continue
            if pos + arr.size > total:
                raise ValueError(f"{path}: more tokens than the {total} counted")
            if arr.min() < 0 or arr.max() > limit:
                raise ValueError(f"{path}: token ids outside 0..{limit}")
            assert out is not None
            out[pos : pos + arr.size] = arr
            pos += arr.size
        if pos != total:
            raise ValueError(f"{path}: got {pos} tokens, counted {total}")
        if out is not None:
            out.flush()
            del out
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return total


def split_documents(n_docs: int, val_fraction: float, seed: int = SPLIT_SEED):
    """Deterministic (train_indices, val_indices) of a document split, each in corpus order.

    Returns None when there are too few documents for both splits to get one; the caller then
    splits the token stream instead.
    """
    n_val = int(n_docs * val_fraction + 0.5)
    if n_docs < 2 or n_val < 1 or n_val >= n_docs:
        return None
    perm = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _encode_docs(tok: Tokenizer, docs: Sequence[str], add_eot: bool) -> np.ndarray:
    parts = []
    for start in range(0, len(docs), ENCODE_BATCH_DOCS):
        for ids in tok.encode_batch(docs[start : start + ENCODE_BATCH_DOCS]):
            if add_eot:
                ids = [*ids, tok.eot_token]
            parts.append(np.asarray(ids, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _eot_note(tok: Tokenizer) -> str:
    return f"; eot id {tok.eot_token} after each document" if tok.eot_token is not None else ""


Spans = list[list[Any]]  # [[part name, first token, end token], ...] of one split, in order


def _encode_parts(tok: Tokenizer, docs: Sequence[str], labels: np.ndarray, names: list[str],
                  add_eot: bool) -> tuple[np.ndarray, Spans]:
    """The tokens of `docs` (each labelled with its part's index into `names`, the labels in
    corpus order) and the span of each part in them."""
    arrays: list[np.ndarray] = []
    spans: Spans = []
    pos = 0
    edges = np.flatnonzero(np.diff(labels)) + 1
    for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), len(docs)], strict=True):
        if hi <= lo:
            continue
        ids = _encode_docs(tok, docs[lo:hi], add_eot)  # per document, so the same tokens
        arrays.append(ids)
        if len(ids):
            spans.append([names[int(labels[lo])], pos, pos + len(ids)])
        pos += len(ids)
    return (np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)), spans


def _clip(spans: Spans, lo: int, hi: int) -> Spans:
    """The parts of `spans` inside [lo, hi), counted from lo."""
    return [[name, max(a, lo) - lo, min(b, hi) - lo] for name, a, b in spans
            if min(b, hi) > max(a, lo)]


def _split_local(
    tok: Tokenizer, docs: list[str], val_fraction: float,
    parts: Sequence[tuple[str, int]] = (),
) -> tuple[np.ndarray, np.ndarray, str, dict[str, Spans] | None]:
    """Token arrays for train and val, a description of the split and, for a source made of
    named parts, which tokens of each split come from which part."""
    add_eot = tok.eot_token is not None and len(docs) > 1
    pct = f"{val_fraction:.4g}"
    names = [name for name, _ in parts] or [""]
    labels = np.repeat(np.arange(len(parts)), [n for _, n in parts]) if parts \
        else np.zeros(len(docs), dtype=np.int64)
    if len(labels) != len(docs):
        raise ValueError(f"the parts count {len(labels)} documents, the source has {len(docs)}")
    split = split_documents(len(docs), val_fraction)
    if split is not None:
        train_idx, val_idx = split
        train, train_spans = _encode_parts(tok, [docs[i] for i in train_idx], labels[train_idx],
                                           names, add_eot)
        val, val_spans = _encode_parts(tok, [docs[i] for i in val_idx], labels[val_idx], names,
                                       add_eot)
        desc = (
            f"documents: {len(val_idx)} of {len(docs)} documents (round({pct} * n), chosen with "
            f"numpy default_rng({SPLIT_SEED}).permutation) are val, the rest train, each in "
            f"corpus order{_eot_note(tok) if add_eot else ''}"
        )
    else:
        ids, spans = _encode_parts(tok, docs, labels, names, add_eot)
        n_train = int(len(ids) * (1 - val_fraction))
        desc = f"stream: the first {n_train} tokens are train, the last {pct} of the stream val"
        if len(docs) > 1:
            desc += f" ({len(docs)} documents concatenated{_eot_note(tok) if add_eot else ''})"
        train, val = ids[:n_train], ids[n_train:]
        train_spans, val_spans = _clip(spans, 0, n_train), _clip(spans, n_train, len(ids))
    return train, val, desc, ({"train": train_spans, "val": val_spans} if parts else None)


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise QkvlabError(
            f"val fraction {val_fraction} is outside (0, 1): pass e.g. --val-fraction 0.1"
        )


def _existing_meta(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / "meta.json"
    if not path.exists():
        return None
    try:
        return read_json_object(path, fix="")
    except QkvlabError:
        return {}  # unreadable: counts as "different settings"


def _files_intact(out_dir: Path, meta: dict[str, Any]) -> bool:
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        return all(
            (out_dir / f"{split}.bin").stat().st_size == int(meta[f"{split}_tokens"]) * itemsize
            for split in ("train", "val")
        )
    except (OSError, KeyError, TypeError, ValueError):
        return False


def _settings(tokenizer: str, source_sha256: str, val_fraction: float) -> dict[str, Any]:
    """What a prepared folder must match to be reused (the keys of _SETTINGS)."""
    return {
        "format": FORMAT,
        "tokenizer": tokenizer,
        "source_sha256": source_sha256,
        "val_fraction": val_fraction,
        "split_seed": SPLIT_SEED,
    }


def _reuse_or_clear(
    out_dir: Path, settings: dict[str, Any], overwrite: bool, say: Callable[[str], None]
) -> dict[str, Any] | None:
    """The existing meta if out_dir already holds these exact settings; else make room or raise."""
    if out_dir.exists() and not out_dir.is_dir():
        raise QkvlabError(f"output {out_dir} is a file, not a folder: choose another --out")
    old = _existing_meta(out_dir)
    if old is None:
        return None
    same = all(old.get(k) == settings[k] for k in _SETTINGS)
    if same and _files_intact(out_dir, old):
        say(f"{out_dir} is already prepared with these settings; reusing it")
        return old
    if not same and not overwrite:
        diff = [
            f"{k} {old.get(k)!r} vs {settings[k]!r}" for k in _SETTINGS if old.get(k) != settings[k]
        ]
        raise QkvlabError(
            f"{out_dir} already holds data prepared with other settings ({'; '.join(diff)}): "
            "pass --force to overwrite it or choose another --out"
        )
    # Remove meta.json first: if we crash while rewriting, the dir reads as incomplete.
    (out_dir / "meta.json").unlink(missing_ok=True)
    return None


def _finish(
    out_dir: Path,
    tok: Tokenizer,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Save tokenizer files, drop stale ones, then write meta.json (last)."""
    tok.save(out_dir)
    for name in TOKENIZER_FILES:
        if name not in tok.files:
            (out_dir / name).unlink(missing_ok=True)
    write_bytes_atomic(out_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def prepare(
    source: str = "shakespeare",
    tokenizer: str = "char",
    out_dir: Path | str | None = None,
    val_fraction: float | None = None,
    num_proc: int = 1,
    *,
    overwrite: bool = False,
    text_field: str = "text",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokenise `source` with `tokenizer` into out_dir/{train,val}.bin and meta.json.

    val_fraction defaults to 0.1 (0.0005 for Hugging Face datasets). An existing dir prepared with
    the same settings is reused; one with other settings needs overwrite=True. Returns the meta.
    """
    parse_spec(tokenizer)  # fail on a bad spec before reading anything
    if num_proc < 1:
        raise QkvlabError(f"--num-proc must be at least 1, got {num_proc}")
    kind = source_kind(source)
    if val_fraction is None:
        val_fraction = HF_VAL_FRACTION if kind == "hf" else DEFAULT_VAL_FRACTION
    _check_val_fraction(val_fraction)
    out_dir = Path(out_dir) if out_dir is not None else default_data_dir(source, tokenizer)
    say = log or (lambda _msg: None)
    if kind == "hf":
        return _prepare_hf(
            source, tokenizer, out_dir, val_fraction, num_proc, overwrite, text_field, say
        )

    docs, digest, parts = read_source_parts(source, text_field=text_field)
    settings = _settings(tokenizer, digest, val_fraction)
    old = _reuse_or_clear(out_dir, settings, overwrite, say)
    if old is not None:
        if parts and SOURCE_SPANS not in old:
            return _add_source_spans(out_dir, old, docs, val_fraction, parts, say)
        return old

    tok = build_tokenizer(tokenizer, docs)
    train, val, split_desc, spans = _split_local(tok, docs, val_fraction, parts)
    if len(train) == 0 or len(val) == 0:
        raise QkvlabError(
            f"source {source} is too small to split ({len(train) + len(val)} tokens): "
            "give more text or another --val-fraction"
        )
    dtype = token_dtype(tok.vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokens(out_dir / "train.bin", [train], len(train), dtype)
    write_tokens(out_dir / "val.bin", [val], len(val), dtype)
    meta = _meta(settings, tok, dtype, len(train), len(val), split_desc, source, kind, len(docs))
    if spans is not None:
        meta[SOURCE_SPANS] = spans
    return _finish(out_dir, tok, meta)


def _add_source_spans(out_dir: Path, meta: dict[str, Any], docs: list[str], val_fraction: float,
                      parts: Sequence[tuple[str, int]], say: Callable[[str], None]
                      ) -> dict[str, Any]:
    """A folder prepared before folders recorded their source spans, given them in its
    meta.json: the tokens are split again and must equal its files, which stay as they are."""
    tok = load_tokenizer(out_dir, meta)
    train, val, _desc, spans = _split_local(tok, docs, val_fraction, parts)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    same = all(np.array_equal(np.fromfile(out_dir / f"{name}.bin", dtype=dtype), ids)
               for name, ids in (("train", train), ("val", val)))
    if not same:
        say(f"{out_dir} holds other tokens than this qkvlab makes of the source: its meta.json "
            "records no source spans (prepare it again with --force for a per-source val loss)")
        return meta
    meta = {**meta, SOURCE_SPANS: spans}
    write_bytes_atomic(out_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    say(f"{out_dir}: recorded in meta.json which tokens come from which part of the source")
    return meta


def _meta(
    settings: dict[str, Any],
    tok: Tokenizer,
    dtype: np.dtype,
    n_train: int,
    n_val: int,
    split: str,
    source: str,
    kind: str,
    n_docs: int,
) -> dict[str, Any]:
    return {
        **settings,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "train_tokens": int(n_train),
        "val_tokens": int(n_val),
        "split": split,
        "source": source,
        "source_kind": kind,
        "documents": int(n_docs),
        "eot_token": tok.eot_token,
        "tokenizer_files": list(tok.files),
    }


class _BatchEncoder:
    """datasets.map function: text column -> ids (+ eot) and their count.

    Picklable (it holds only the spec and a folder), so map(num_proc>1) can ship it to workers,
    each of which rebuilds the tokenizer once from the saved files.
    """

    def __init__(self, spec: str, data_dir: Path, text_field: str) -> None:
        self.spec, self.data_dir, self.text_field = spec, str(data_dir), text_field
        self._tok: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self._tok is None:
            self._tok = load_tokenizer(Path(self.data_dir), {"tokenizer": self.spec})
        tok = self._tok
        ids = tok.encode_batch(batch[self.text_field])
        if tok.eot_token is not None:
            ids = [[*row, tok.eot_token] for row in ids]
        return {"ids": ids, "len": [len(row) for row in ids]}


def shard_ids(dataset: Any, n_shards: int, index: int) -> np.ndarray:
    """The concatenated "ids" (int64) of contiguous shard `index` of `n_shards`."""
    shard = dataset.shard(num_shards=n_shards, index=index, contiguous=True)
    if hasattr(shard, "with_format"):
        shard = shard.with_format("numpy")
    rows = shard["ids"]
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path, fix="")
    except QkvlabError:
        return {}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def write_shards_resumable(
    path: Path,
    tokenized: Any,
    total: int,
    dtype: np.dtype,
    key: dict[str, Any],
    say: Callable[[str], None] = lambda _msg: None,
    max_shards: int | None = None,
) -> int:
    """Write the "ids" of a tokenized dataset to `path`, shard by shard; a rerun resumes.

    Tokens go into `.NAME.partial` (a memmap of the final size). After each shard the memmap is
    flushed and `.NAME.progress.json` records the shards and tokens done, so a crash costs at
    most one shard: the next run with the same `key` (settings, token count, shard count)
    continues there; any other key starts over. The finished file is renamed into place and its
    progress file marked complete, which lets a rerun skip the split altogether.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    n_shards = max(1, min(max_shards or MAX_SHARDS, len(tokenized)))
    key = {**key, "tokens": int(total), "shards": n_shards, "dtype": dtype.name}
    nbytes = int(total) * dtype.itemsize
    partial = path.with_name(f".{path.name}.partial")
    progress = path.with_name(f".{path.name}.progress.json")
    rec = _read_json(progress)
    if rec.get("key") == key and rec.get("complete") and _size(path) == nbytes:
        say(f"{path.name} was already written by an earlier run; keeping it")
        return int(total)
    done, pos = 0, 0
    if rec.get("key") == key and not rec.get("complete") and _size(partial) == nbytes:
        done, pos = int(rec.get("shards_done", 0)), int(rec.get("tokens_done", 0))
        say(f"resuming {path.name} at shard {done} of {n_shards} ({pos:,} tokens written)")
    else:
        progress.unlink(missing_ok=True)
        with open(partial, "wb") as f:
            f.truncate(nbytes)  # sparse: the memmap below fills it
    limit = np.iinfo(dtype).max
    out = np.memmap(partial, dtype=dtype, mode="r+", shape=(int(total),))
    try:
        for index in range(done, n_shards):
            arr = shard_ids(tokenized, n_shards, index)
            if pos + arr.size > total:
                raise ValueError(f"{path}: more tokens than the {total} counted")
            if arr.size and (arr.min() < 0 or arr.max() > limit):
                raise ValueError(f"{path}: token ids outside 0..{limit}")
            out[pos : pos + arr.size] = arr
            pos += arr.size
            out.flush()  # the tokens reach the file before the progress that vouches for them
            write_bytes_atomic(progress, json.dumps({"key": key, "shards_done": index + 1,
                                               "tokens_done": pos}).encode())
        if pos != total:
            raise ValueError(f"{path}: got {pos} tokens, counted {total}")
    finally:
        del out
    os.replace(partial, path)
    write_bytes_atomic(progress, json.dumps({"key": key, "complete": True}).encode())
    return int(total)


def _hf_texts(dataset: Any, text_field: str) -> Iterator[str]:
    for start in range(0, len(dataset), ENCODE_BATCH_DOCS):
        yield from dataset[start : start + ENCODE_BATCH_DOCS][text_field]


def _prepare_hf(
    source: str,
    tokenizer: str,
    out_dir: Path,
    val_fraction: float,
    num_proc: int,
    overwrite: bool,
    text_field: str,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The OpenWebText path: split, map-tokenise with num_proc workers, write shards to memmaps."""
    dataset = load_hf_dataset(source, num_proc=num_proc)
    if text_field not in dataset.column_names:
        raise QkvlabError(
            f"Hugging Face dataset {source} has no column {text_field!r} "
            f"(it has {', '.join(dataset.column_names)}): choose the text column"
        )
    settings = _settings(tokenizer, hf_fingerprint(source, dataset), val_fraction)
    old = _reuse_or_clear(out_dir, settings, overwrite, say)
    if old is not None:
        return old

    out_dir.mkdir(parents=True, exist_ok=True)
    # char / bpe:N are fitted on the whole corpus (as for local sources) before the split.
    tok = build_tokenizer(tokenizer, _hf_texts(dataset, text_field))
    tok.save(out_dir)  # map workers rebuild the tokenizer from these files

    split = dataset.train_test_split(test_size=val_fraction, seed=SPLIT_SEED, shuffle=True)
    parts = {"train": split["train"], "val": split["test"]}
    dtype = token_dtype(tok.vocab_size)
    encoder = _BatchEncoder(tokenizer, out_dir, text_field)
    counts = {}
    for name, part in parts.items():
        tokenized = part.map(
            encoder,
            batched=True,
            remove_columns=part.column_names,
            num_proc=num_proc if num_proc > 1 else None,
            desc=f"tokenizing {name}",
        )
        lengths = tokenized.with_format("numpy")["len"] if hasattr(tokenized, "with_format") \
            else tokenized["len"]  # numpy: no Python list of millions of ints
        total = int(np.sum(lengths, dtype=np.int64))
        if total == 0:
            raise QkvlabError(
                f"the {name} split of {source} has no tokens: use a bigger dataset or "
                "--val-fraction"
            )
        # tokenising is resumable through the datasets cache (a deterministic fingerprint);
        # writing is resumable per shard
        counts[name] = write_shards_resumable(
            out_dir / f"{name}.bin", tokenized, total, dtype, settings, say
        )
    desc = (
        f"hf: train_test_split(test_size={val_fraction}, seed={SPLIT_SEED}, shuffle=True), "
        f"'test' renamed 'val'{_eot_note(tok)}"
    )
    meta = _meta(
        settings, tok, dtype, counts["train"], counts["val"], desc, source, "hf", len(dataset)
    )
    meta = _finish(out_dir, tok, meta)
    for name in parts:  # meta.json now vouches for the files: the progress notes are done
        (out_dir / f".{name}.bin.progress.json").unlink(missing_ok=True)
    return meta
