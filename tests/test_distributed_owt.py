"""The OpenWebText path of `qkvlab prepare` on a small local `datasets.Dataset`.

`qkvlab prepare openwebtext --tokenizer gpt2` needs the Hugging Face hub; here the same code path
(load -> train_test_split(0.0005, seed 2357) -> multiprocess map -> uint16 memmaps written shard
by shard) runs on a dataset built in the test and saved to disk like a hub download.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from qkvlab.data.loader import TokenData
from qkvlab.data.tokenizer import build_tokenizer

datasets = pytest.importorskip("datasets")
prepare_module = importlib.import_module("qkvlab.data.prepare")
EOT = 50256


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """4000 short "web pages", on disk (Arrow files) as load_dataset would leave them."""
    rng = np.random.default_rng(0)
    words = "the of and to in is was for on that with as by at from it his an were are".split()
    texts = [f"page {i}: " + " ".join(rng.choice(words, size=5 + i % 23)) + "."
             for i in range(4000)]
    root = tmp_path_factory.mktemp("web")
    datasets.Dataset.from_dict({"text": texts, "url": [f"u{i}" for i in range(4000)]}
                               ).save_to_disk(str(root / "ds"))
    return datasets.load_from_disk(str(root / "ds"))


@pytest.fixture
def hub(web, monkeypatch):
    """load_hf_dataset returns the local dataset; records the num_proc it was asked for."""
    calls = []

    def load(source, num_proc=1):
        calls.append((source, num_proc))
        return web

    monkeypatch.setattr(prepare_module, "load_hf_dataset", load)
    # 1024 shards of 4 documents would spend the test on fsyncs of the progress file
    monkeypatch.setattr(prepare_module, "MAX_SHARDS", 32)
    return calls


def expected_split(web):
    split = web.train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    return split["train"]["text"], split["test"]["text"]


def encode(texts: list[str]) -> list[int]:
    tok = build_tokenizer("gpt2")
    return [i for ids in tok.encode_batch(texts) for i in [*ids, EOT]]


@pytest.mark.slow
def test_owt_path_split_multiprocess_uint16(web, hub, tmp_path):
    out = tmp_path / "owt"
    meta = prepare_module.prepare("openwebtext", "gpt2", out, num_proc=2)
    assert hub == [("openwebtext", 2)]  # multiprocess loading too
    assert meta["val_fraction"] == 0.0005 and meta["split_seed"] == 2357
    assert meta["dtype"] == "uint16" and meta["documents"] == 4000
    assert meta["split"].startswith("hf: train_test_split(test_size=0.0005, seed=2357, "
                                    "shuffle=True), 'test' renamed 'val'")
    train_texts, val_texts = expected_split(web)
    assert len(val_texts) == 2  # round(0.0005 * 4000)
    data = TokenData(out)
    assert data.dtype == np.dtype("<u2")
    # the tokens are exactly the split's documents, in the split's order, each ended by EOT
    assert np.asarray(data.val).tolist() == encode(val_texts)
    assert np.asarray(data.train).tolist() == encode(train_texts)
    assert (out / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert not list(out.glob(".*"))  # no partial or progress files left behind
    # a rerun with the same settings reuses the complete output
    before = (out / "meta.json").stat().st_mtime_ns
    prepare_module.prepare("openwebtext", "gpt2", out, num_proc=2)
    assert (out / "meta.json").stat().st_mtime_ns == before


@pytest.mark.slow
def test_owt_write_resumes_after_a_crash(web, hub, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "MAX_SHARDS", 16)  # 10 of them before the crash
    whole = tmp_path / "whole"
    prepare_module.prepare("openwebtext", "gpt2", whole)

    real = prepare_module.shard_ids
    calls: list[int] = []

    def crash_at_train_shard_10(dataset, n_shards, index):
        calls.append(index)
        if len(calls) == 11:
            raise RuntimeError("power cut")
        return real(dataset, n_shards, index)

    out = tmp_path / "owt"
    monkeypatch.setattr(prepare_module, "shard_ids", crash_at_train_shard_10)
    with pytest.raises(RuntimeError, match="power cut"):
        prepare_module.prepare("openwebtext", "gpt2", out)
    assert not (out / "meta.json").exists()  # incomplete: TokenData refuses it
    progress = json.loads((out / ".train.bin.progress.json").read_text())
    assert progress["shards_done"] == 10 and (out / ".train.bin.partial").exists()

    calls.clear()
    monkeypatch.setattr(prepare_module, "shard_ids",
                        lambda d, n, i: calls.append(i) or real(d, n, i))
    logs: list[str] = []
    prepare_module.prepare("openwebtext", "gpt2", out, log=logs.append)
    assert any("resuming train.bin at shard 10 of 16" in line for line in logs)
    assert calls[:6] == list(range(10, 16))  # train: only the 6 shards not yet written
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (out / name).read_bytes() == (whole / name).read_bytes()
    assert not list(out.glob(".*"))


def test_owt_complete_split_is_kept_when_a_later_one_failed(web, hub, tmp_path, monkeypatch):
    real = prepare_module.write_shards_resumable

    def fail_on_val(path, *args, **kwargs):
        if path.name == "val.bin":
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    out = tmp_path / "owt"
    monkeypatch.setattr(prepare_module, "write_shards_resumable", fail_on_val)
    with pytest.raises(OSError):
        prepare_module.prepare("openwebtext", "gpt2", out)
    train_bytes = (out / "train.bin").read_bytes()
    monkeypatch.setattr(prepare_module, "write_shards_resumable", real)
    logs: list[str] = []
    prepare_module.prepare("openwebtext", "gpt2", out, log=logs.append)
    assert any("train.bin was already written" in line for line in logs)
    assert (out / "train.bin").read_bytes() == train_bytes
    assert TokenData(out).val_tokens > 0


def test_stale_progress_of_other_settings_starts_over(tmp_path):
    rows = datasets.Dataset.from_dict({"ids": [[1, 2], [3], [4, 5, 6]], "len": [2, 1, 3]})
    path = tmp_path / "train.bin"
    prepare_module.write_shards_resumable(path, rows, 6, np.dtype("<u2"), {"tokenizer": "a"})
    assert np.fromfile(path, dtype="<u2").tolist() == [1, 2, 3, 4, 5, 6]
    # the same file name under another key is not trusted: rewritten from the first shard
    rows2 = datasets.Dataset.from_dict({"ids": [[9], [8, 7]], "len": [1, 2]})
    prepare_module.write_shards_resumable(path, rows2, 3, np.dtype("<u2"), {"tokenizer": "b"})
    assert np.fromfile(path, dtype="<u2").tolist() == [9, 8, 7]
    assert Path(tmp_path / ".train.bin.progress.json").exists()
