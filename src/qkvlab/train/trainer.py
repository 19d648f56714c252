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
from qkvlab.fsutil import write_text_atomic
from qkvlab.model import GPT
from qkvlab.model.params import count_params, flops_per_token
from qkvlab.train import checkpoint as ck
from qkvlab.train import distributed, guard, objectives
from qkvlab.train.config import EMBEDDED_SOURCE, DataConfig, RunConfig, save_config
from qkvlab.train.optim import build_optimizer, lr_at, set_lr
from qkvlab.train.perf import keep_freed_memory, mfu, peak_flops_for

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
    # DDP vs FSDP is how processes share the work, not what they compute; the world size is
    # not in the config at all: the global batch is the same for any number of processes
    "train.parallel",
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
    """An exclusive lock file (pid, host, process start time) so two runs never share a folder.

    A lock whose process is dead (SIGKILL, power cut) is taken over; the start time tells a
    recycled pid from the process that wrote the lock. The check-and-create runs under an
    flock of the run folder, so two runs racing for a stale lock cannot both win. A run folder
    this lock had to create is removed again on exit if nothing was written into it.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.token = f"{os.getpid()} {socket.gethostname()} {_start_time(os.getpid()) or '-'}"
        self._created: list[Path] = []  # folders mkdir made, deepest first

    @staticmethod
    def _alive(pid: int, host: str, started: str = "-") -> bool:
        if host != socket.gethostname():
            return True  # cannot check another machine: assume it is running
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        now = _start_time(pid)
        # the pid is taken, but by a process started after the lock's writer: pid reuse
        return started == "-" or now is None or now == started

    def __enter__(self) -> RunLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise QkvlabError(f"run dir {self.run_dir} is a file, not a folder: choose another "
                              "--out")
        missing = self.run_dir
        while not missing.exists() and missing != missing.parent:
            self._created.append(missing)
            missing = missing.parent
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with _dir_mutex(self.run_dir):
                self._acquire()
        except OSError as exc:
            self._remove_created()
            raise QkvlabError(f"cannot lock run dir {self.run_dir} "
                              f"({exc.strerror or exc}): choose another --out") from None
        except BaseException:
            self._remove_created()
            raise
        return self

    def _acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    fields_ = self.path.read_text(encoding="utf-8").split()
                    pid, host = int(fields_[0]), fields_[1]
                    started = fields_[2] if len(fields_) > 2 else "-"
                except (OSError, ValueError, IndexError):
                    pid, host, started = -1, "", "-"  # empty or garbled: died while writing it
                if pid > 0 and self._alive(pid, host, started):
                    raise QkvlabError(
                        f"run dir {self.run_dir} is in use by process {pid} on {host} (lock "
                        f"file {self.path}): wait for it, or delete the lock file if that "
                        "process is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process is dead
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.token + "\n")
            return
        raise QkvlabError(f"cannot take the lock {self.path}: another run keeps replacing it")

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()  # only if empty: never delete what someone wrote
            except OSError:
                break

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.path.read_text(encoding="utf-8").strip() == self.token:
                self.path.unlink()
        except OSError:
            pass
        self._remove_created()


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _dir_mutex(folder: Path):
    """flock a folder for a moment (POSIX); a no-op where folders cannot be flocked."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. a network file system without flock: the O_EXCL create still guards
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


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
    last_good: Path | None = None  # the newest checkpoint saved outside a non-finite streak
    nonfinite: int = 0
    skipped: int = 0  # non-finite steps skipped over the whole run
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
    # refuse an absurd config before anything is allocated, locked or written
    guard.train_memory_check(cfg, resolve_device(cfg.train.device))
    # under torchrun every process runs this; rank 0 alone holds the lock and writes files
    with distributed.session(resolve_device(cfg.train.device)) as ctx, \
            (RunLock(run_dir) if ctx.is_main else contextlib.nullcontext()):
        try:
            return _train_locked(cfg, run_dir, resume, quiet, ctx)
        except OSError as exc:  # disk full, read-only, ...: one line naming the good checkpoint
            err = ck.storage_error(exc, run_dir)
            if err is None or err is exc:
                raise
            raise err from exc


def _train_locked(cfg: RunConfig, run_dir: Path, resume: bool, quiet: bool,
                  ctx: distributed.DistContext | None = None) -> dict[str, Any]:
    ctx = ctx or distributed.DistContext(device=resolve_device(cfg.train.device))
    quiet = quiet or not ctx.is_main  # one voice: rank 0 prints, logs and writes files
    say = (lambda _msg: None) if quiet else (lambda msg: print(msg, flush=True))
    if ctx.is_main:
        ck.clean_temp(run_dir)
    ctx.barrier()  # the other ranks look for checkpoints once the leftovers are gone
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
    device = ctx.device  # cuda:LOCAL_RANK under torchrun
    check_dtype(device, tc.dtype)
    if device.type == "cpu":
        keep_freed_memory()  # no page faults for each step's activations
    plan = distributed.plan_batches(tc.batch_size, tc.grad_accum, ctx.world_size, ctx.rank)
    data = open_data(cfg.data, say)
    check_vocab(cfg, data)
    objectives.check_objective(cfg, data.vocab_size)
    block = cfg.model.block_size
    val_x, val_y = data.val_windows(tc.eval_windows, block)
    val_x, val_y = objectives.eval_inputs(cfg, data.vocab_size, val_x, val_y)  # mlm: fixed mask
    data.train_batch(0, 0, 1, block, tc.seed)  # fail now, not at step 1, if data is too short
    # a multi-node run needs one run folder and one data dir that every node sees
    ctx.agree((ckpt.path.name if ckpt else None, data.train_tokens, data.val_tokens),
              "checkpoints or data")

    # Same seed -> same initial weights, whatever happened in this process before.
    torch.manual_seed(tc.seed)
    model = GPT(cfg.model).to(device)
    if ckpt is not None:
        ck.load_model_state(model, ckpt)  # into the whole model, before FSDP shards it
    use_compile = tc.compile if tc.compile is not None else device.type == "cuda"
    # plain on one process, DDP or FSDP2 under torchrun; par.fwd is what forwards call
    par = distributed.Parallel(model, ctx, tc.parallel, use_compile, plan)
    optimizer = build_optimizer(model, cfg.optim)  # after wrapping: under FSDP it holds shards
    if not ctx.is_main:
        torch.manual_seed(distributed.rank_seed(tc.seed, ctx.rank))  # dropout masks of its own
    st = _State()
    if ckpt is not None:
        par.load_optimizer(optimizer, ckpt)
        par.restore_rng(ckpt.state, tc.seed, ckpt.step)
        saved_world = int(ckpt.state.get("world_size", 1))
        if saved_world != ctx.world_size:
            say(f"{ckpt.path.name} was written by {saved_world} process(es), this run has "
                f"{ctx.world_size}: the global batch and its data stream are the same")
        st.step = ckpt.step
        st.best_val_loss = ckpt.state.get("best_val_loss") or math.inf
        st.last_val_loss = ckpt.state.get("val_loss")
        st.last_ckpt = st.last_good = ckpt.path
        st.skipped = ckpt.state.get("skipped_steps", 0)
        say(f"resuming {run_dir} from {ckpt.path.name} (step {st.step})")
    elif resume:
        say(f"no checkpoint in {run_dir}: starting fresh")
    start_step = st.step
    # Written only now that config, data and checkpoint have all been accepted: a refused
    # input leaves the run folder as it was. The saved config names its folder, so
    # `qkvlab train RUN_DIR --resume` finds it again.
    if ctx.is_main:
        save_config(dataclasses.replace(cfg, out_dir=str(run_dir)), run_dir / CONFIG_FILE)
        _copy_tokenizer(data, run_dir)

    fwd = par.fwd
    params = count_params(cfg.model)
    fpt = flops_per_token(cfg.model, block)
    peak, peak_src = peak_flops_for(device, tc.dtype, tc.peak_flops)
    peak *= ctx.world_size  # tokens/s counts the whole job, so MFU is against all devices
    tokens_per_step = cfg.tokens_per_step
    say(f"run {run_dir}: {params.total:,} params ({params.non_embedding:,} non-embedding), "
        f"{tokens_per_step:,} tokens/step, {device.type} {tc.dtype}, steps {start_step}->"
        f"{tc.max_steps}, peak {peak / 1e12:.3g} TFLOP/s ({peak_src})")
    if ctx.enabled:
        say(f"{ctx.world_size} processes ({par.mode}): each runs {plan.micro_steps_per_rank} "
            f"micro-step(s) of {plan.rows_per_micro_step} rows per step")

    metrics = MetricsLog(run_dir / METRICS_FILE, start_step if ckpt is not None else None) \
        if ctx.is_main else distributed.NullLog()
    tb = _open_tensorboard(run_dir, start_step if ckpt is not None else None) \
        if tc.tensorboard and ctx.is_main else None
    reporter = Reporter(tc.max_steps, start_step, quiet)
    eval_bs = tc.eval_batch_size or tc.batch_size
    interrupted = False

    def val_loss(rec: dict[str, Any]) -> float:
        if tc.objective == "mlm":  # masked-token loss, and accuracy (train/objectives.py)
            val, rec["val_acc"] = objectives.evaluate_masked(par, val_x, val_y, eval_bs, tc.dtype)
            return val
        return par.evaluate(val_x, val_y, eval_bs, tc.dtype)

    def run_eval(step: int, rec: dict[str, Any]) -> None:
        val = val_loss(rec)
        rec["val_loss"], rec["val_ppl"] = val, perplexity(val)
        st.last_val_loss = val
        ppl = perplexity(val)
        reporter.line(f"step {step} | val loss {val:.4f} | val ppl "
                      f"{ppl if ppl is not None else math.nan:.2f}")
        if tb is not None:
            tb.add_scalar("val/loss", val, step)
        if step > 0 and val < st.best_val_loss:
            st.best_val_loss = val
            par.save(lambda m, _o, extra: ck.write_checkpoint(
                run_dir / ck.BEST_DIR, m, cfg, state={**ckpt_state(step), **extra, "kind": "best"}
            ), None)
        elif step == 0:
            st.best_val_loss = min(st.best_val_loss, val)

    def ckpt_state(step: int) -> dict[str, Any]:
        return {"step": step, "tokens": step * tokens_per_step, "best_val_loss": st.best_val_loss,
                "val_loss": st.last_val_loss, "world_size": ctx.world_size, "parallel": par.mode,
                # batches are a pure function of these: a resume continues the same stream
                "data_stream": {"seed": tc.seed, "next_step": step, **plan.as_dict()},
                "skipped_steps": st.skipped}

    def save(step: int) -> None:
        # every process takes part (FSDP gathers its shards); rank 0 writes
        st.last_ckpt = par.save(lambda m, o, extra: ck.save_checkpoint(
            run_dir, step, m, o, cfg, {**ckpt_state(step), **extra}, tc.keep_last), optimizer)
        if st.nonfinite == 0:
            st.last_good = st.last_ckpt

    try:
        with _StopFlag() as stop:
            model.train()
            if ckpt is None:
                rec0 = {"step": 0, "tokens": 0, "lr": lr_at(0, cfg.optim, tc.max_steps)}
                run_eval(0, rec0)
                metrics.write(rec0)
            for step in range(start_step, tc.max_steps):
                rec = _train_step(fwd, model, optimizer, data, cfg, step, device, st, par)
                done = step + 1
                st.step = done
                if rec["loss"] is None:
                    if st.nonfinite >= tc.max_nonfinite:
                        where = (f"the last good checkpoint is {st.last_good}" if st.last_good
                                 else "no good checkpoint was saved")
                        # `done` is the step number metrics.jsonl and ckpt-* folders use
                        raise QkvlabError(
                            f"training diverged: non-finite loss or gradient for "
                            f"{st.nonfinite} consecutive steps (the last at step {done}); "
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
                # all processes stop at the same step, even if the signal reached only some
                if ctx.any(stop.signum is not None):
                    interrupted = True
                    save(done)
                    reporter.line(f"stopped by signal {stop.signum} at step {done}; checkpoint "
                                  f"{st.last_ckpt}")
                    break
                # no regular checkpoint inside a non-finite streak: it would rotate good ones
                # out (keep_last) in favour of the weights that keep failing
                if (done % tc.ckpt_interval == 0 or done == tc.max_steps) and st.nonfinite == 0:
                    save(done)
            if start_step >= tc.max_steps and ckpt is not None:
                st.last_val_loss = val_loss({})
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
        "skipped_steps": st.skipped,
        "world_size": ctx.world_size,
    }
    # JSON has no NaN/inf: a diverged or empty value is null
    summary = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
               for k, v in summary.items()}
    if ctx.is_main:
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
    par: distributed.Parallel | None = None,
) -> dict[str, Any]:
    """One optimizer step (grad_accum micro-batches); a non-finite step is skipped.

    Under torchrun `par` deals this process its share of the micro-batches (BatchPlan) and
    syncs gradients once, after the last of them.
    """
    tc = cfg.train
    if par is None:
        plan = distributed.plan_batches(tc.batch_size, tc.grad_accum, 1, 0)
        par = distributed.Parallel(model, distributed.DistContext(device), tc.parallel, False,
                                   plan)
    t0 = time.perf_counter()
    lr = lr_at(step, cfg.optim, tc.max_steps)
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), device=device)
    micros = par.micro_steps()  # one process: micro-steps 0..grad_accum-1, whole
    for i, micro in enumerate(micros):
        x, y = data.train_batch(step, micro.index, micro.rows, cfg.model.block_size, tc.seed,
                                micro.part, micro.parts)
        x, y = objectives.train_inputs(cfg, data.vocab_size, x, y, step, micro.index, micro.part,
                                       micro.parts)  # clm: unchanged; mlm: masked
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with par.grad_sync(i == len(micros) - 1):
            with autocast(device, tc.dtype):
                _, loss = fwd(x, y)
            (loss / len(micros)).backward()
        loss_sum += loss.detach()
    # clip_grad_norm_ with an infinite bound only measures: the norm is logged either way
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = par.clip_grad_norm(max_norm)  # the global norm, the same on every process
    train_loss = par.mean_loss(loss_sum)
    finite = math.isfinite(train_loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        st.nonfinite = 0
    else:
        st.nonfinite += 1  # skip the update: the weights stay as they were
        st.skipped += 1
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
