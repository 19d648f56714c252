"""Read a prepared data dir and cut it into training and validation windows.

Batches are pure functions of their arguments. In the default order, "random", the window
offsets of (seed, step, micro_step) come from a generator seeded by exactly those numbers: windows
are drawn with replacement, so a long run repeats some tokens before it has seen others. In the
"shuffled" order the training split is cut into disjoint windows, visited in a random order that
is a function of (seed, epoch): each token is a target once an epoch (but for less than two
windows at the ends), and a run shorter than an epoch sees no token twice. Either way resuming at a
step replays the same batches, and DDP ranks take disjoint slices of one global batch, which is
the same for any world size.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkvlab.data.tokenizer import Tokenizer, load_tokenizer
from qkvlab.errors import QkvlabError
from qkvlab.jsonfile import read_json_object

ID_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning for out-of-range ids
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REQUIRED = ("format", "tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens")
ORDERS = ("random", "shuffled")  # how training windows are drawn (data.order)
_SHUFFLE_TAG = 0x5AFF1E  # keeps the shuffled order's generators apart from the random order's


def batch_seed(seed: int, step: int, micro_step: int) -> int:
    """A 63-bit generator seed for one (seed, step, micro_step); stable across versions.

    numpy's SeedSequence mixes the three numbers so that nearby triples give unrelated streams.
    """
    for name, value in (("seed", seed), ("step", step), ("micro_step", micro_step)):
        if int(value) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return mix_seed(seed, step, micro_step)


def mix_seed(*words: int) -> int:
    """A 63-bit generator seed mixing `words` (numpy's SeedSequence: nearby inputs diverge)."""
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(2)
    return (int(state[0]) << 31) ^ int(state[1])


def epoch_length(n_tokens: int, block_size: int) -> int:
    """Windows an epoch of the shuffled order holds: as many disjoint windows as fit after
    any offset below block_size (at least one)."""
    return max(1, (n_tokens - block_size) // block_size)


@functools.lru_cache(maxsize=2)  # the epoch a batch is in and the next: 8 bytes a window
def _epoch_windows(n_tokens: int, block_size: int, seed: int, epoch: int) -> np.ndarray:
    """The start offsets of one epoch of the shuffled order: windows of block_size + 1 tokens
    that overlap by one (so each token is a target once), from an offset drawn per epoch (the
    window edges move between epochs), in a random order."""
    k = epoch_length(n_tokens, block_size)
    gen = np.random.Generator(np.random.PCG64(mix_seed(_SHUFFLE_TAG, seed, epoch)))
    offset = int(gen.integers(min(block_size, n_tokens - k * block_size)))
    return offset + gen.permutation(k).astype(np.int64) * block_size


def shuffled_starts(n_tokens: int, block_size: int, seed: int, first: int, count: int
                    ) -> np.ndarray:
    """Windows first .. first + count - 1 of the shuffled order, epoch after epoch."""
    k = epoch_length(n_tokens, block_size)
    out = np.empty(count, dtype=np.int64)
    i = 0
    while i < count:
        epoch, at = divmod(first + i, k)
        take = min(count - i, k - at)
        out[i:i + take] = _epoch_windows(n_tokens, block_size, seed, epoch)[at:at + take]
        i += take
    return out


def _windows(data: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[torch.Tensor, ...]:
    """x = data[s : s + block], y = data[s + 1 : s + block + 1] for each start s, as int64."""
    idx = starts.astype(np.int64)[:, None] + np.arange(block_size + 1, dtype=np.int64)
    rows = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _meta_problem(meta: dict[str, Any]) -> str | None:
    """What in meta.json would crash or mislead later (types, ranges, file names), or None.

    meta.json is data on disk: it must never steer a read or a copy outside its folder
    (tokenizer_files are copied into the run folder) or reach int() as junk.
    """
    vocab = meta["vocab_size"]
    if not _is_int(vocab) or not 1 <= vocab <= 1 << 32:
        return f"vocab_size {vocab!r} is not an integer in [1, 2**32]"
    for key in ("train_tokens", "val_tokens"):
        if not _is_int(meta[key]) or meta[key] < 0:
            return f"{key} {meta[key]!r} is not a non-negative integer"
    if not isinstance(meta["tokenizer"], str):
        return f"tokenizer {meta['tokenizer']!r} is not a string"
    eot = meta.get("eot_token")
    if eot is not None and (not _is_int(eot) or not 0 <= eot < vocab):
        return f"eot_token {eot!r} is not a token id below vocab_size"
    problem = _spans_problem(meta.get("source_spans"), meta)
    if problem:
        return problem
    names = meta.get("tokenizer_files", [])
    if not isinstance(names, list) or not all(
            isinstance(n, str) and n and n == Path(n).name and n not in (".", "..")
            and "\\" not in n and "\0" not in n for n in names):
        return f"tokenizer_files {names!r} is not a list of plain file names"
    return None


def _spans_problem(spans: Any, meta: dict[str, Any]) -> str | None:
    """What is wrong with meta.json's source_spans (prepare's record of which tokens of a split
    come from which part of the corpus), or None; a folder without them is fine."""
    if spans is None:
        return None
    if not isinstance(spans, dict) or not set(spans) <= {"train", "val"}:
        return f"source_spans {spans!r} is not a table of train and val spans"
    for split, rows in spans.items():
        end = 0
        for row in rows if isinstance(rows, list) else [None]:
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                    and row[0] and _is_int(row[1]) and _is_int(row[2])
                    and end <= row[1] < row[2] <= meta[f"{split}_tokens"]):
                return (f"source_spans of {split} holds {row!r}, not [part, first, end] in "
                        "order inside the split")
            end = row[2]
    return None


def spread_starts(n_tokens: int, block_size: int, tokens: int) -> np.ndarray:
    """Start offsets of the windows that score `tokens` targets (the whole split when it holds
    fewer) spread evenly over a split of n_tokens: the first at 0, the last at the end, no two
    sharing a target (each window holds block_size + 1 tokens, x and its shifted y)."""
    if tokens < 1 or block_size < 1 or n_tokens < block_size + 1:
        raise ValueError(f"need tokens >= 1 and n_tokens > block_size >= 1, got {tokens=}, "
                         f"{n_tokens=}, {block_size=}")
    count = min(-(-tokens // block_size), (n_tokens - 1) // block_size)
    if count == 1:
        return np.zeros(1, dtype=np.int64)
    last = n_tokens - block_size - 1
    # integer arithmetic (the same starts everywhere); count * block <= n - 1 keeps the gaps
    # between starts at least block_size
    return np.arange(count, dtype=np.int64) * last // (count - 1)


class TokenData:
    """Memory-mapped train/val tokens of a dir written by `qkvlab prepare`."""

    def __init__(self, data_dir: Path | str, check_ids: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.meta = self._read_meta()
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_token: int | None = self.meta.get("eot_token")
        self.dtype = _DTYPES[self.meta["dtype"]]
        self.train = self._open("train")
        self.val = self._open("val")
        if check_ids:
            for split in ("train", "val"):
                self._check_ids(split)
        self._tokenizer: Tokenizer | None = None

    def _no_data(self, why: str) -> QkvlabError:
        return QkvlabError(
            f"no prepared data at {self.data_dir} ({why}): run `qkvlab prepare shakespeare "
            f"--tokenizer char --out {self.data_dir}`"
        )

    def _read_meta(self) -> dict[str, Any]:
        path = self.data_dir / "meta.json"
        if not path.is_file():
            raise self._no_data("no meta.json")
        try:
            meta = read_json_object(path, fix="")
        except QkvlabError:  # the fix here is to prepare the folder again
            raise self._no_data("meta.json is unreadable") from None
        if not isinstance(meta, dict) or any(k not in meta for k in _REQUIRED):
            raise self._no_data("meta.json lacks required fields")
        if meta["format"] != 1:
            raise QkvlabError(
                f"{path} has format {meta['format']!r}, this qkvlab reads format 1: "
                "re-run qkvlab prepare with this version"
            )
        if not isinstance(meta["dtype"], str) or meta["dtype"] not in _DTYPES:
            raise self._no_data(f"unknown dtype {meta['dtype']!r} in meta.json")
        problem = _meta_problem(meta)
        if problem:
            raise self._no_data(f"meta.json is malformed: {problem}")
        return meta

    def _open(self, split: str) -> np.ndarray:
        path = self.data_dir / f"{split}.bin"
        count = int(self.meta[f"{split}_tokens"])
        rerun = f"re-run `qkvlab prepare` for {self.data_dir} (with --force)"
        if not path.is_file():
            raise QkvlabError(f"{path} is missing: {rerun}")
        size, expected = path.stat().st_size, count * self.dtype.itemsize
        if size != expected:
            state = "truncated" if size < expected else "longer than meta.json says"
            raise QkvlabError(f"{path} is {state} ({size} bytes, expected {expected}): {rerun}")
        if count == 0:  # np.memmap cannot map an empty file
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(count,))

    def _check_ids(self, split: str) -> None:
        data = self.train if split == "train" else self.val
        if np.iinfo(self.dtype).max < self.vocab_size:
            return  # every value the dtype can hold is a valid id
        for start in range(0, len(data), ID_CHECK_CHUNK):
            top = int(data[start : start + ID_CHECK_CHUNK].max())
            if top >= self.vocab_size:
                raise QkvlabError(
                    f"{self.data_dir / f'{split}.bin'} holds token id {top} but vocab_size is "
                    f"{self.vocab_size}: the data does not match its meta.json; re-run "
                    "`qkvlab prepare` (with --force)"
                )

    @property
    def tokenizer(self) -> Tokenizer:
        """The data's tokenizer, loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.data_dir, self.meta)
        return self._tokenizer

    @property
    def train_tokens(self) -> int:
        return len(self.train)

    @property
    def val_tokens(self) -> int:
        return len(self.val)

    def _need(self, split: str, n: int, block_size: int) -> None:
        if block_size < 1:
            raise QkvlabError(f"block_size must be at least 1, got {block_size}")
        if n < block_size + 1:
            raise QkvlabError(
                f"the {split} split of {self.data_dir} has {n} tokens, fewer than block_size + 1 "
                f"= {block_size + 1}: use a smaller block_size or more data"
            )

    def train_batch(
        self,
        step: int,
        micro_step: int,
        batch_size: int,
        block_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        order: str = "random",
        grad_accum: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s slice (batch_size rows) of the global batch for (seed, step, micro_step).

        The global batch has batch_size * world_size windows, drawn in `order` (ORDERS; the
        shuffled order counts micro-batches, so it needs the step's `grad_accum`); x and y are
        int64 of shape (batch_size, block_size), y being x shifted by one token.
        """
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size=}, "
                f"{rank=}, {world_size=}"
            )
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if order == "shuffled" and not 0 <= micro_step < grad_accum:
            raise ValueError(f"need 0 <= micro_step < grad_accum, got {micro_step=}, "
                             f"{grad_accum=}")
        self._need("train", len(self.train), block_size)
        rows = batch_size * world_size
        if order == "shuffled":
            first = (step * grad_accum + micro_step) * rows
            starts = shuffled_starts(len(self.train), block_size, seed, first, rows)
        else:
            gen = torch.Generator().manual_seed(batch_seed(seed, step, micro_step))
            n_starts = len(self.train) - block_size  # starts 0..n-block-1 leave room for y
            starts = torch.randint(n_starts, (rows,), generator=gen).numpy()
        mine = starts[rank * batch_size : (rank + 1) * batch_size]
        return _windows(self.train, mine, block_size)

    def val_window_starts(self, num_windows: int, block_size: int) -> np.ndarray:
        """Evenly spaced start offsets over the val split, first at 0 and last at the end."""
        if num_windows < 1:
            raise ValueError(f"num_windows must be >= 1, got {num_windows}")
        self._need("val", len(self.val), block_size)
        last = len(self.val) - block_size - 1
        if num_windows == 1:
            return np.zeros(1, dtype=np.int64)
        # Integer arithmetic: the same starts on every platform, no float rounding.
        return np.arange(num_windows, dtype=np.int64) * last // (num_windows - 1)

    def val_windows(self, num_windows: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed, RNG-free set of val windows: identical for every run on the same data.

        If num_windows exceeds the distinct starts available, some windows repeat.
        """
        starts = self.val_window_starts(num_windows, block_size)
        return _windows(self.val, starts, block_size)

    def val_windows_at(self, starts: np.ndarray, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The val windows (x, y) that start at `starts`."""
        self._need("val", len(self.val), block_size)
        return _windows(self.val, starts, block_size)

    def source_spans(self, split: str) -> list[tuple[str, int, int]] | None:
        """Which tokens of `split` come from which part of the corpus, as (part, first, end) in
        order; None for a folder that does not record it (a source without parts, or one
        prepared before prepare recorded them)."""
        rows = (self.meta.get("source_spans") or {}).get(split)
        return None if rows is None else [(str(n), int(a), int(b)) for n, a, b in rows]

    def __repr__(self) -> str:
        return (
            f"TokenData({str(self.data_dir)!r}, tokenizer={self.meta['tokenizer']!r}, "
            f"vocab_size={self.vocab_size}, train={len(self.train)}, val={len(self.val)})"
        )
