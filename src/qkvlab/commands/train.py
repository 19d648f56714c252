"""`qkvlab train`, `qkvlab eval` and `qkvlab sample`: thin wrappers over the train package."""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qkvlab.commands.common import Subparsers, add_overrides, register
from qkvlab.errors import QkvlabError, require

if TYPE_CHECKING:
    import torch

    from qkvlab.model import GPT
    from qkvlab.run.checkpoint import Checkpoint


# ---- train ---------------------------------------------------------------------------------
@dataclass
class TrainOptions:
    config: str
    out: str | None = None
    resume: bool = False
    overrides: list[str] = field(default_factory=list)


def run_train(opts: TrainOptions) -> int:
    """Train from a config file, run folder or preset; print a one-line summary."""
    from qkvlab import interrupts
    from qkvlab.run.config import load_config
    from qkvlab.train import train
    from qkvlab.train.distributed import env_rank

    cfg = load_config(opts.config, list(opts.overrides))
    if opts.out:
        cfg = dataclasses.replace(cfg, out_dir=str(opts.out))
    elif Path(opts.config).is_dir():
        cfg = dataclasses.replace(cfg, out_dir=str(opts.config))  # `train RUN_DIR --resume`
    interrupts.arm(f"qkvlab train {shlex.quote(str(cfg.run_dir))} --resume")
    summary = train(cfg, resume=opts.resume)
    # stopped by a signal: its checkpoint is written; 128 + the signal, as a shell reports it
    code = 128 + summary["signal"] if summary["interrupted"] else 0
    if env_rank() != 0:
        return code  # under torchrun rank 0 speaks for the job
    val, ppl = summary["final_val_loss"], summary["final_val_ppl"]
    val_s = "no val loss" if val is None else \
        f"val loss {val:.4f} (ppl {ppl if ppl is not None else math.nan:.2f})"
    val_step = summary.get("final_val_step")
    if val is not None and val_step != summary["steps"]:  # stopped between evals
        val_s = "last " + val_s + (f" at step {val_step}" if val_step is not None else "")
    state = "stopped" if summary["interrupted"] else "done"
    print(f"{state} at step {summary['steps']}: {val_s}, {summary['tokens_per_s']:,.0f} tok/s, "
          f"MFU {100 * summary['mfu']:.1f}%, run {cfg.run_dir}")
    if summary["interrupted"]:
        print(f"resume with: qkvlab train {cfg.run_dir} --resume")
    return code


def _load(path: str) -> tuple[GPT, Checkpoint, torch.device]:
    from qkvlab.model import GPT
    from qkvlab.run.checkpoint import load_model_state
    from qkvlab.run.device import resolve_device
    from qkvlab.run.store import read_checkpoint

    ckpt = read_checkpoint(path)
    # where the run trained does not matter here: use a GPU when there is one
    device = resolve_device("auto")
    model = GPT(ckpt.config.model)
    load_model_state(model, ckpt)
    model.to(device).eval()
    return model, ckpt, device


# ---- eval ----------------------------------------------------------------------------------
@dataclass
class EvalOptions:
    path: str
    windows: int | None = None
    data: str | None = None
    lm_eval: str | None = None
    lm_eval_limit: int | None = None
    lm_eval_batch_size: int | None = None
    dtype: str | None = None
    tasks: str | None = None  # downstream tasks (qkvlab.downstream), comma-separated
    limit: int | None = None
    batch_size: int | None = None

    def validate(self) -> None:
        """One mode at a time: val loss, --tasks, or --lm-eval, each with its own options."""
        require(not (self.tasks is not None and self.lm_eval),
                "--tasks and --lm-eval are two ways to run downstream tasks: give one")
        for name, value in (("--limit", self.limit), ("--batch-size", self.batch_size)):
            require(value is None or self.tasks is not None, f"{name} goes with --tasks")
        for name, value in (("--windows", self.windows), ("--data", self.data)):
            require(value is None or self.tasks is None,
                    f"{name} is for the validation loss, not --tasks: drop it")


def eval_dtype(opts: EvalOptions, ckpt: Checkpoint) -> str:
    """--dtype, else fp32 for an imported model (it is compared with transformers' float32
    logits; bf16 autocast moves its loss in the 4th decimal), else the run's train.dtype."""
    from qkvlab.run.load import IMPORTED_KIND

    if opts.dtype:
        return opts.dtype
    return "fp32" if ckpt.state.get("kind") == IMPORTED_KIND else ckpt.config.train.dtype


def run_eval(opts: EvalOptions) -> int:
    """Print the validation loss and perplexity of a checkpoint on fixed val windows (or,
    with --tasks / --lm-eval, its downstream task scores)."""
    opts.validate()
    if opts.tasks is not None:  # downstream tasks with qkvlab's own scorer
        return _run_downstream(opts)
    if opts.lm_eval:  # lm-evaluation-harness instead (qkvlab.hf.harness)
        return _run_lm_eval(opts)
    from qkvlab.run import guard
    from qkvlab.run.device import evaluate, perplexity
    from qkvlab.run.load import check_vocab, data_config, open_data

    model, ckpt, device = _load(opts.path)
    cfg = ckpt.config
    dtype = eval_dtype(opts, ckpt)
    data_cfg = data_config(ckpt, opts.data)  # the run's, or --data
    data = open_data(data_cfg)
    check_vocab(cfg, data)
    windows = opts.windows if opts.windows is not None else cfg.train.eval_windows
    if windows < 1:
        raise QkvlabError(f"--windows must be at least 1, got {windows}")
    block = cfg.model.block_size
    guard.check_bytes(f"{windows:,} validation windows of {block} tokens",
                      16 * windows * (block + 1), guard.host_memory(), "this machine",
                      "pass fewer --windows")
    x, y = data.val_windows(windows, block)
    if cfg.train.objective == "mlm":  # an encoder: masked-token loss and accuracy, fixed mask
        from qkvlab.train import objectives

        x, y = objectives.eval_inputs(cfg, data.vocab_size, x, y)
        loss, acc = objectives.evaluate_model_masked(
            model, x, y, cfg.train.eval_batch_size or cfg.train.batch_size, device, dtype)
        _refuse_nonfinite(ckpt, loss)
        print(f"{ckpt.path} (step {ckpt.step}): masked-token loss {loss:.4f}, accuracy "
              f"{acc:.4f} ({windows} windows x {block} tokens of {data.data_dir})")
        return 0
    loss = evaluate(model, x, y, cfg.train.eval_batch_size or cfg.train.batch_size, device,
                    dtype)
    _refuse_nonfinite(ckpt, loss)
    ppl = perplexity(loss)
    print(f"{ckpt.path} (step {ckpt.step}): val loss {loss:.4f}, perplexity "
          f"{ppl if ppl is not None else math.nan:.2f} ({windows} windows x {block} tokens of "
          f"{data.data_dir})")
    return 0


def _refuse_nonfinite(ckpt: Checkpoint, loss: float) -> None:
    """Finite weights can still overflow in the forward pass: that is no val loss to report.

    (Non-finite weights are refused earlier, by load_model_state.)
    """
    if not math.isfinite(loss):
        raise QkvlabError(f"checkpoint {ckpt.path} (step {ckpt.step}) gives a non-finite val "
                          f"loss ({loss}): its weights come from a diverged run; evaluate an "
                          "earlier checkpoint")


def _run_downstream(opts: EvalOptions) -> int:
    """Score the tasks, print their table and the skip counts, write the JSON record."""
    from qkvlab.console import print_table
    from qkvlab.downstream.evaluate import DEFAULT_BATCH_SIZE, DownstreamOptions, evaluate, save
    from qkvlab.downstream.report import results_table, skip_lines
    from qkvlab.downstream.tasks import parse_tasks

    spec = DownstreamOptions(
        parse_tasks(opts.tasks or ""), limit=opts.limit, dtype=opts.dtype or "fp32",
        batch_size=DEFAULT_BATCH_SIZE if opts.batch_size is None else opts.batch_size)
    done = evaluate(opts.path, spec)
    rec = done.record
    print_table(results_table(done.results, f"{rec['checkpoint']} (step {rec['step']}), "
                                            f"zero-shot, {rec['dtype']}"))
    for line in skip_lines(done.results):
        print(line)
    print(f"results written to {save(done)}")
    return 0


def _run_lm_eval(opts: EvalOptions) -> int:
    """Export if needed, run lm-eval on the tasks, print its table."""
    from qkvlab.hf.harness import evaluate_tasks, format_results, parse_tasks

    tasks = parse_tasks(opts.lm_eval or "")
    results = evaluate_tasks(Path(opts.path).expanduser(), tasks, limit=opts.lm_eval_limit,
                             batch_size=opts.lm_eval_batch_size or 8)
    print(format_results(results))
    return 0


# ---- sample --------------------------------------------------------------------------------
@dataclass
class SampleOptions:
    path: str
    prompt: str = "\n"
    max_new_tokens: int = 200
    num_samples: int = 1
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 1337
    stop_token: int | None = None
    no_cache: bool = False
    compile: bool = False

    def validate(self, vocab: int) -> None:
        """Refuse settings generate() cannot honour; `vocab` is the model's."""
        require(self.max_new_tokens >= 0,
                f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        require(self.num_samples >= 1, f"--num-samples must be >= 1, got {self.num_samples}")
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        require(self.top_k is None or self.top_k >= 1, f"--top-k must be >= 1, got {self.top_k}")
        require(self.top_p is None or 0 < self.top_p <= 1,
                f"--top-p must be in (0, 1], got {self.top_p}")
        require(self.stop_token is None or 0 <= self.stop_token < vocab,
                f"--stop-token must be a token id in [0, {vocab}), got {self.stop_token}")
        require(0 <= self.seed < 1 << 63, f"--seed must be in [0, 2**63), got {self.seed}")


def run_sample(opts: SampleOptions) -> int:
    """Generate text from a checkpoint with the run's tokenizer and print it."""
    import torch

    from qkvlab.model.generate import generate
    from qkvlab.run import guard
    from qkvlab.run.layout import TOKENIZER_DIR
    from qkvlab.run.load import run_tokenizer

    model, ckpt, device = _load(opts.path)
    tok = run_tokenizer(ckpt)
    if tok.vocab_size > model.cfg.vocab_size:  # its ids would index past the embedding table
        raise QkvlabError(
            f"the tokenizer of {ckpt.path} has {tok.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size}: the run's {TOKENIZER_DIR}/ does not belong to it"
        )
    opts.validate(model.cfg.vocab_size)
    m, n_new = model.cfg, opts.max_new_tokens
    # the ids (int64) and, with the cache, K and V of every layer for every sample
    cache = 0 if opts.no_cache else 8 * m.n_layer * m.n_embd * min(m.block_size, n_new + 1)
    guard.check_bytes(f"{opts.num_samples:,} samples of {n_new:,} tokens",
                      opts.num_samples * (8 * n_new + cache),
                      guard.device_memory(device), f"the {device.type} device",
                      "lower --num-samples or --max-new-tokens")
    prompt = tok.encode(opts.prompt)
    if not prompt:
        raise QkvlabError("the prompt encodes to no tokens: pass a non-empty --prompt")
    idx = torch.tensor([prompt] * opts.num_samples, dtype=torch.long, device=device)
    # fp32 sampling: cheap at this size, and no dtype mixing between the KV cache and autocast
    out = generate(model, idx, n_new, temperature=opts.temperature, top_k=opts.top_k,
                   top_p=opts.top_p, seed=opts.seed, stop_token=opts.stop_token,
                   use_cache=not opts.no_cache, compile=opts.compile)
    # a padded model vocab (e.g. 50304) may emit ids the tokenizer lacks: drop them
    texts = [tok.decode([i for i in row if i < tok.vocab_size]) for row in out.tolist()]
    print("\n---\n".join(texts))
    return 0


# ---- registration --------------------------------------------------------------------------
def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", help="TOML config file, or a preset name (see `qkvlab presets`)")
    p.add_argument("--out", help="run folder (overrides run.out_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    add_overrides(p)
    register(p, TrainOptions, run_train, trains=True)

    p = sub.add_parser("eval", help="validation loss (or downstream tasks) of a run or "
                                    "checkpoint")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("--windows", type=int, help="number of validation windows")
    p.add_argument("--data", help="prepared data folder (default: the run's)")
    p.add_argument("--dtype", choices=["bf16", "fp32"],
                   help="evaluation precision (default: the run's train.dtype; fp32 for an "
                        "imported model and for --tasks)")
    p.add_argument("--tasks", metavar="TASKS",
                   help="score downstream tasks (comma-separated: hellaswag, piqa, winogrande, "
                        "arc_easy, arc_challenge, lambada) offline with qkvlab's own scorer; "
                        "see docs/eval.md")
    p.add_argument("--limit", type=int, metavar="N",
                   help="with --tasks: the first N items of each task")
    p.add_argument("--batch-size", type=int, metavar="B",
                   help="with --tasks: sequences per forward pass (default 32)")
    p.add_argument("--lm-eval", metavar="TASKS",
                   help="run lm-evaluation-harness tasks (comma-separated) on the model exported "
                        "to transformers instead; PATH may also be a `qkvlab export` folder")
    p.add_argument("--lm-eval-limit", type=int, metavar="N",
                   help="with --lm-eval: at most N examples per task")
    p.add_argument("--lm-eval-batch-size", type=int, metavar="B",
                   help="with --lm-eval: batch size (default 8)")
    register(p, EvalOptions, run_eval)

    p = sub.add_parser("sample", help="generate text from a run or checkpoint")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("--prompt")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--num-samples", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop-token", type=int)
    p.add_argument("--no-cache", action="store_true", help="recompute the prefix every token")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model first: seconds up front, faster per token")
    register(p, SampleOptions, run_sample)
