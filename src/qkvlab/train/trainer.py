"""The training loop: deterministic batches, AdamW, warmup + cosine, eval, checkpoints, resume.

Exact resume rests on three facts: batches are a pure function of (seed, step, micro_step), a
checkpoint restores model, optimizer and RNG states bit for bit, and nothing else carries state
between steps. So N steps straight and N/2 steps + resume give the same losses on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvlab.data.loader import TokenData
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.model.params import count_params, flops_per_token
from qkvlab.train import checkpoint as ck
from qkvlab.train.config import EMBEDDED_SOURCE, DataConfig, RunConfig, save_config
from qkvlab.train.fsutil import write_text_atomic
from qkvlab.train.optim import build_optimizer, lr_at, set_lr
from qkvlab.train.perf import mfu, peak_flops_for

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.toml"
LOCK_FILE = ".lock"
TOKENIZER_DIR = "tokenizer"
# Keys that may differ between a run's saved config and the one it resumes with: they change
# bookkeeping (length, logging, where things are), not the training trajectory.
RESUME_HARMLESS = frozenset({
    "run.name", "run.out_dir", "data.dir", "data.prepare_if_missing",
    "train.max_steps", "train.eval_interval", "train.eval_windows", "train.eval_batch_size",
    "train.log_interval", "train.ckpt_interval", "train.keep_last", "train.compile",
    "train.device", "train.max_nonfinite", "train.peak_flops", "train.tensorboard",
})


# ---- device, numerics, data ---------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    """train.device -> torch.device ("auto": CUDA when visible, else CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise QkvlabError("train.device = cuda but no CUDA GPU is visible: "
                          "use --set train.device=cpu (or auto)")
    return torch.device(name)


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device (matmuls in bf16, losses and norms in fp32), or nothing."""
    if dtype != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def check_dtype(device: torch.device, dtype: str) -> None:
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise QkvlabError(f"{torch.cuda.get_device_name(device)} has no bf16 support: "
                          "use --set train.dtype=fp32")


def open_data(dc: DataConfig, log=print) -> TokenData:
    """The run's prepared data; the embedded corpus is prepared on first use."""
    data_dir = Path(dc.dir)
    if not (data_dir / "meta.json").is_file():
        if dc.prepare_if_missing and dc.source == EMBEDDED_SOURCE:
            from qkvlab.data.prepare import prepare

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


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    device: torch.device,
    dtype: str,
) -> float:
    """Mean per-token loss over the fixed windows (x, y), in eval mode under the same autocast."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, x.size(0), batch_size):
            xb = x[start:start + batch_size].to(device)
            yb = y[start:start + batch_size].to(device)
            with autocast(device, dtype):
                _, loss = model(xb, yb)
            # every window has the same length, so weighting by rows gives the token mean
            total += float(loss) * xb.size(0)
            count += xb.size(0)
    finally:
        model.train(was_training)
    return total / count


def perplexity(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf


# ---- run folder bookkeeping ---------------------------------------------------------------
class RunLock:
    """An exclusive lock file (pid and host) so two runs never share a run folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.token = f"{os.getpid()} {socket.gethostname()}"

    @staticmethod
    def _alive(pid: int, host: str) -> bool:
        if host != socket.gethostname():
            return True  # cannot check another machine: assume it is running
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid_s, host = self.path.read_text(encoding="utf-8").split()[:2]
                    pid = int(pid_s)
                except (OSError, ValueError):
                    pid, host = -1, ""  # empty or garbled: a run died while writing it
                if pid > 0 and self._alive(pid, host):
                    raise QkvlabError(
                        f"run dir {self.run_dir} is in use by process {pid} on {host} (lock "
                        f"file {self.path}): wait for it, or delete the lock file if that "
                        "process is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process is dead
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.token + "\n")
            return self
        raise QkvlabError(f"cannot take the lock {self.path}: another run keeps replacing it")

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.path.read_text(encoding="utf-8").strip() == self.token:
                self.path.unlink()
        except OSError:
            pass


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed per write; resume drops later lines."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("", encoding="utf-8")
        else:
            kept = []
            if path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        if int(json.loads(line)["step"]) <= resume_step:
                            kept.append(line)
                    except (ValueError, KeyError, TypeError):
                        continue  # a line torn by a crash
            write_text_atomic(path, "".join(k + "\n" for k in kept))
        self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        # JSON has no NaN/inf: non-finite values are written as null.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self.f.write(json.dumps(clean) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl."""
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _open_tensorboard(run_dir: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)


def _copy_tokenizer(data: TokenData, run_dir: Path) -> None:
    """Copy meta.json and the tokenizer tables into the run, so sampling needs no data dir."""
    dest = run_dir / TOKENIZER_DIR
    dest.mkdir(exist_ok=True)
    names = ["meta.json", *data.meta.get("tokenizer_files", [])]
    for name in names:
        src = data.data_dir / name
        if src.is_file():
            write_text_atomic(dest / name, src.read_text(encoding="utf-8"))


def _config_diff(saved: RunConfig, now: RunConfig) -> list[str]:
    a, b = saved.to_dict(), now.to_dict()
    diffs = []
    for section in a:
        for key in sorted(set(a[section]) | set(b.get(section, {}))):
            name = f"{section}.{key}"
            old, new = a[section].get(key), b.get(section, {}).get(key)
            if name not in RESUME_HARMLESS and old != new:
                diffs.append(f"{name} (saved {old!r}, now {new!r})")
    return diffs


# ---- progress display ---------------------------------------------------------------------
def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Reporter:
    """A rich progress bar on a terminal, plain lines otherwise, nothing when quiet."""

    def __init__(self, total: int, start: int, quiet: bool):
        self.quiet = quiet
        self.progress = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True, highlight=False),
            )
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def step(self, step: int, total: int, rec: dict[str, Any], eta: float, log: bool) -> None:
        loss = rec.get("loss")
        loss_s = f"loss {loss:.4f}" if loss is not None else "loss non-finite"
        speed = f"{rec.get('tokens_per_s', 0):,.0f} tok/s"
        if self.progress is not None:
            info = f"{loss_s} | {speed} | eta {_fmt_eta(eta)}"
            self.progress.update(self.task, completed=step, info=info)
        elif log:
            mfu_pct = 100 * (rec.get("mfu") or 0.0)
            self.line(f"step {step}/{total} | {loss_s} | lr {rec['lr']:.2e} | {speed} | "
                      f"mfu {mfu_pct:.1f}% | eta {_fmt_eta(eta)}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints and returns. A second SIGINT aborts."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# ---- the loop -----------------------------------------------------------------------------
@dataclass
class _State:
    step: int = 0
    best_val_loss: float = math.inf
    last_val_loss: float | None = None
    last_ckpt: Path | None = None
    nonfinite: int = 0
    session_tokens: int = 0
    session_time: float = 0.0
    window_tokens: int = 0  # since the last log line, for its tokens/s
    window_time: float = 0.0
    history: list[float] = field(default_factory=list)  # recent step times, for the ETA


def train(cfg: RunConfig, resume: bool = False, *, quiet: bool = False) -> dict[str, Any]:
    """Train `cfg` in cfg.run_dir; with resume, continue from its latest checkpoint.

    Returns the summary also written to summary.json (final val loss, tokens/s, params, ...).
    """
    run_dir = cfg.run_dir
    with RunLock(run_dir):
        return _train_locked(cfg, run_dir, resume, quiet)


def _train_locked(cfg: RunConfig, run_dir: Path, resume: bool, quiet: bool) -> dict[str, Any]:
    say = (lambda _msg: None) if quiet else (lambda msg: print(msg, flush=True))
    ck.clean_temp(run_dir)
    existing = ck.list_checkpoints(run_dir)
    if existing and not resume:
        raise QkvlabError(f"run dir {run_dir} already has checkpoints: pass --resume or choose "
                          "another --out")
    ckpt = ck.read_checkpoint(run_dir) if existing else None
    if ckpt is not None:
        diffs = _config_diff(ckpt.config, cfg)
        if diffs:
            raise QkvlabError(
                f"the config differs from the one run {run_dir} was trained with at "
                f"{'; '.join(diffs[:5])}: resume with the run's config ({run_dir / CONFIG_FILE}) "
                "or choose another --out"
            )

    tc = cfg.train
    device = resolve_device(tc.device)
    check_dtype(device, tc.dtype)
    data = open_data(cfg.data, say)
    check_vocab(cfg, data)
    block = cfg.model.block_size
    val_x, val_y = data.val_windows(tc.eval_windows, block)
    data.train_batch(0, 0, 1, block, tc.seed)  # fail now, not at step 1, if data is too short
    # the saved config names its folder, so `qkvlab train RUN_DIR --resume` finds it again
    save_config(dataclasses.replace(cfg, out_dir=str(run_dir)), run_dir / CONFIG_FILE)
    _copy_tokenizer(data, run_dir)

    # Same seed -> same initial weights, whatever happened in this process before.
    torch.manual_seed(tc.seed)
    model = GPT(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    st = _State()
    if ckpt is not None:
        ck.load_model_state(model, ckpt)
        ck.load_optimizer_state(optimizer, ckpt)
        ck.set_rng_state(ckpt.state["rng"])
        st.step = ckpt.step
        st.best_val_loss = ckpt.state.get("best_val_loss") or math.inf
        st.last_val_loss = ckpt.state.get("val_loss")
        st.last_ckpt = ckpt.path
        say(f"resuming {run_dir} from {ckpt.path.name} (step {st.step})")
    elif resume:
        say(f"no checkpoint in {run_dir}: starting fresh")
    start_step = st.step

    use_compile = tc.compile if tc.compile is not None else device.type == "cuda"
    fwd = torch.compile(model) if use_compile else model
    params = count_params(cfg.model)
    fpt = flops_per_token(cfg.model, block)
    peak, peak_src = peak_flops_for(device, tc.dtype, tc.peak_flops)
    tokens_per_step = cfg.tokens_per_step
    say(f"run {run_dir}: {params.total:,} params ({params.non_embedding:,} non-embedding), "
        f"{tokens_per_step:,} tokens/step, {device.type} {tc.dtype}, steps {start_step}->"
        f"{tc.max_steps}, peak {peak / 1e12:.3g} TFLOP/s ({peak_src})")

    metrics = MetricsLog(run_dir / METRICS_FILE, start_step if ckpt is not None else None)
    tb = _open_tensorboard(run_dir, start_step if ckpt is not None else None) \
        if tc.tensorboard else None
    reporter = Reporter(tc.max_steps, start_step, quiet)
    eval_bs = tc.eval_batch_size or tc.batch_size
    interrupted = False

    def run_eval(step: int, rec: dict[str, Any]) -> None:
        val = evaluate(fwd, val_x, val_y, eval_bs, device, tc.dtype)
        rec["val_loss"], rec["val_ppl"] = val, perplexity(val)
        st.last_val_loss = val
        ppl = perplexity(val)
        reporter.line(f"step {step} | val loss {val:.4f} | val ppl "
                      f"{ppl if ppl is not None else math.nan:.2f}")
        if tb is not None:
            tb.add_scalar("val/loss", val, step)
        if step > 0 and val < st.best_val_loss:
            st.best_val_loss = val
            ck.write_checkpoint(run_dir / ck.BEST_DIR, model, cfg,
                                state={**ckpt_state(step), "kind": "best"})
        elif step == 0:
            st.best_val_loss = min(st.best_val_loss, val)

    def ckpt_state(step: int) -> dict[str, Any]:
        return {"step": step, "tokens": step * tokens_per_step, "best_val_loss": st.best_val_loss,
                "val_loss": st.last_val_loss}

    def save(step: int) -> None:
        st.last_ckpt = ck.save_checkpoint(run_dir, step, model, optimizer, cfg, ckpt_state(step),
                                          tc.keep_last)

    try:
        with _StopFlag() as stop:
            model.train()
            if ckpt is None:
                rec0 = {"step": 0, "tokens": 0, "lr": lr_at(0, cfg.optim, tc.max_steps)}
                run_eval(0, rec0)
                metrics.write(rec0)
            for step in range(start_step, tc.max_steps):
                rec = _train_step(fwd, model, optimizer, data, cfg, step, device, st)
                done = step + 1
                st.step = done
                if rec["loss"] is None:
                    if st.nonfinite >= tc.max_nonfinite:
                        where = (f"the last good checkpoint is {st.last_ckpt}" if st.last_ckpt
                                 else "no checkpoint was saved")
                        raise QkvlabError(
                            f"training diverged: non-finite loss or gradient for "
                            f"{st.nonfinite} consecutive steps (the last at step {step}); "
                            f"{where}: lower optim.lr, raise optim.warmup_steps or use "
                            "train.dtype=fp32"
                        )
                recent = st.history[-20:]
                eta = (tc.max_steps - done) * (sum(recent) / len(recent)) if recent else math.inf
                is_eval = done % tc.eval_interval == 0 or done == tc.max_steps
                is_log = done % tc.log_interval == 0 or is_eval or rec["loss"] is None
                if is_log:
                    rec["mfu"] = mfu(fpt, rec["tokens_per_s"], peak)
                    st.window_tokens, st.window_time = 0, 0.0
                    if tb is not None:
                        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                            if rec.get(key) is not None:
                                tb.add_scalar(f"train/{key}", rec[key], done)
                reporter.step(done, tc.max_steps, rec, eta, is_log)
                if is_eval:
                    run_eval(done, rec)
                if is_log:
                    metrics.write({"step": done, **rec})
                if stop.signum is not None:
                    interrupted = True
                    save(done)
                    reporter.line(f"stopped by signal {stop.signum} at step {done}; checkpoint "
                                  f"{st.last_ckpt}")
                    break
                if done % tc.ckpt_interval == 0 or done == tc.max_steps:
                    save(done)
            if start_step >= tc.max_steps and ckpt is not None:
                st.last_val_loss = evaluate(fwd, val_x, val_y, eval_bs, device, tc.dtype)
    finally:
        reporter.close()
        metrics.close()
        if tb is not None:
            tb.close()

    tps = st.session_tokens / st.session_time if st.session_time > 0 else 0.0
    summary = {
        "run_dir": str(run_dir),
        "steps": st.step,
        "tokens": st.step * tokens_per_step,
        "final_val_loss": st.last_val_loss,
        "final_val_ppl": perplexity(st.last_val_loss),
        "best_val_loss": st.best_val_loss if math.isfinite(st.best_val_loss) else None,
        "tokens_per_s": tps,
        "mfu": mfu(fpt, tps, peak),
        "peak_flops": peak,
        "params": params.total,
        "non_embedding_params": params.non_embedding,
        "flops_per_token": fpt,
        "train_time_s": st.session_time,
        "resumed_from": start_step if ckpt is not None else None,
        "interrupted": interrupted,
        "device": device.type,
        "dtype": tc.dtype,
        "checkpoint": str(st.last_ckpt) if st.last_ckpt else None,
    }
    # JSON has no NaN/inf: a diverged or empty value is null
    summary = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
               for k, v in summary.items()}
    write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    return summary


def _train_step(
    fwd: torch.nn.Module,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    data: TokenData,
    cfg: RunConfig,
    step: int,
    device: torch.device,
    st: _State,
) -> dict[str, Any]:
    """One optimizer step (grad_accum micro-batches); a non-finite step is skipped."""
    tc = cfg.train
    t0 = time.perf_counter()
    lr = lr_at(step, cfg.optim, tc.max_steps)
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), device=device)
    for micro in range(tc.grad_accum):
        x, y = data.train_batch(step, micro, tc.batch_size, cfg.model.block_size, tc.seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, tc.dtype):
            _, loss = fwd(x, y)
        (loss / tc.grad_accum).backward()
        loss_sum += loss.detach()
    # clip_grad_norm_ with an infinite bound only measures: the norm is logged either way
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    train_loss = float(loss_sum) / tc.grad_accum
    finite = math.isfinite(train_loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        st.nonfinite = 0
    else:
        st.nonfinite += 1  # skip the update: the weights stay as they were
    optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0  # float(loss) above synchronised the device
    st.history.append(dt)
    del st.history[:-100]
    tokens = cfg.tokens_per_step
    st.session_tokens += tokens
    st.session_time += dt
    st.window_tokens += tokens
    st.window_time += dt
    return {
        "tokens": (step + 1) * tokens,
        "loss": train_loss if finite else None,
        "lr": lr,
        "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
        "tokens_per_s": st.window_tokens / st.window_time if st.window_time > 0 else 0.0,
    }
