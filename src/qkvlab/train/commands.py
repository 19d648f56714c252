"""`qkvlab train`, `qkvlab eval` and `qkvlab sample`: thin wrappers over the train package."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import torch

from qkvlab.data.tokenizer import Tokenizer, load_tokenizer
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.train import guard
from qkvlab.train.checkpoint import Checkpoint, load_model_state, read_checkpoint
from qkvlab.train.config import load_config
from qkvlab.train.trainer import (
    TOKENIZER_DIR,
    check_vocab,
    evaluate,
    open_data,
    perplexity,
    resolve_device,
)


def train_command(args: argparse.Namespace) -> int:
    """Train from a config file, run folder or preset; print a one-line summary."""
    from qkvlab.train.distributed import env_rank
    from qkvlab.train.trainer import train

    cfg = load_config(args.config, list(getattr(args, "overrides", None) or []))
    out = getattr(args, "out", None)
    if out:
        cfg = dataclasses.replace(cfg, out_dir=str(out))
    elif Path(args.config).is_dir():
        cfg = dataclasses.replace(cfg, out_dir=str(args.config))  # `train RUN_DIR --resume`
    summary = train(cfg, resume=bool(getattr(args, "resume", False)))
    if env_rank() != 0:
        return 0  # under torchrun rank 0 speaks for the job
    val, ppl = summary["final_val_loss"], summary["final_val_ppl"]
    val_s = "no val loss" if val is None else \
        f"val loss {val:.4f} (ppl {ppl if ppl is not None else math.nan:.2f})"
    state = "stopped" if summary["interrupted"] else "done"
    print(f"{state} at step {summary['steps']}: {val_s}, {summary['tokens_per_s']:,.0f} tok/s, "
          f"MFU {100 * summary['mfu']:.1f}%, run {summary['run_dir']}")
    if summary["interrupted"]:
        print(f"resume with: qkvlab train {summary['run_dir']} --resume")
    return 0


def _load(path: str) -> tuple[GPT, Checkpoint, torch.device]:
    ckpt = read_checkpoint(path)
    # where the run trained does not matter here: use a GPU when there is one
    device = resolve_device("auto")
    model = GPT(ckpt.config.model)
    load_model_state(model, ckpt)
    model.to(device).eval()
    return model, ckpt, device


def eval_command(args: argparse.Namespace) -> int:
    """Print the validation loss and perplexity of a checkpoint on fixed val windows."""
    if getattr(args, "lm_eval", None):  # lm-evaluation-harness instead (qkvlab.hf.harness)
        from qkvlab.hf.harness import lm_eval_command

        return lm_eval_command(args)
    model, ckpt, device = _load(args.path)
    cfg = ckpt.config
    data_cfg = cfg.data if not args.data else dataclasses.replace(cfg.data, dir=str(args.data))
    data = open_data(data_cfg)
    check_vocab(cfg, data)
    windows = args.windows if args.windows is not None else cfg.train.eval_windows
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
            model, x, y, cfg.train.eval_batch_size or cfg.train.batch_size, device,
            cfg.train.dtype)
        print(f"{ckpt.path} (step {ckpt.step}): masked-token loss {loss:.4f}, accuracy "
              f"{acc:.4f} ({windows} windows x {block} tokens of {data.data_dir})")
        return 0
    loss = evaluate(model, x, y, cfg.train.eval_batch_size or cfg.train.batch_size, device,
                    cfg.train.dtype)
    ppl = perplexity(loss)
    print(f"{ckpt.path} (step {ckpt.step}): val loss {loss:.4f}, perplexity "
          f"{ppl if ppl is not None else math.nan:.2f} ({windows} windows x {block} tokens of "
          f"{data.data_dir})")
    return 0


def run_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The tokenizer a run trained with: its own copy, else the data dir's."""
    for folder in (ckpt.run_dir / TOKENIZER_DIR, ckpt.path / TOKENIZER_DIR,
                   Path(ckpt.config.data.dir)):
        if (folder / "meta.json").is_file():
            return load_tokenizer(folder)
    raise QkvlabError(
        f"cannot find the tokenizer of {ckpt.path} (no {TOKENIZER_DIR}/ in its run and no data "
        f"at {ckpt.config.data.dir}): run `{ckpt.config.data.prepare_hint()}`"
    )


def _check_sample_args(args: argparse.Namespace, vocab: int) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise QkvlabError(msg)

    need(args.max_new_tokens >= 0, f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    need(args.num_samples >= 1, f"--num-samples must be >= 1, got {args.num_samples}")
    need(math.isfinite(args.temperature) and args.temperature >= 0,
         f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    need(args.top_k is None or args.top_k >= 1, f"--top-k must be >= 1, got {args.top_k}")
    need(args.top_p is None or 0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}")
    need(args.stop_token is None or 0 <= args.stop_token < vocab,
         f"--stop-token must be a token id in [0, {vocab}), got {args.stop_token}")
    need(0 <= args.seed < 1 << 63, f"--seed must be in [0, 2**63), got {args.seed}")


def sample_command(args: argparse.Namespace) -> int:
    """Generate text from a checkpoint with the run's tokenizer and print it."""
    from qkvlab.model.generate import generate

    model, ckpt, device = _load(args.path)
    tok = run_tokenizer(ckpt)
    if tok.vocab_size > model.cfg.vocab_size:  # its ids would index past the embedding table
        raise QkvlabError(
            f"the tokenizer of {ckpt.path} has {tok.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size}: the run's {TOKENIZER_DIR}/ does not belong to it"
        )
    _check_sample_args(args, model.cfg.vocab_size)
    m = model.cfg
    # the ids (int64) and, with the cache, K and V of every layer for every sample
    cache = 0 if args.no_cache else 8 * m.n_layer * m.n_embd * min(m.block_size,
                                                                   args.max_new_tokens + 1)
    guard.check_bytes(f"{args.num_samples:,} samples of {args.max_new_tokens:,} tokens",
                      args.num_samples * (8 * args.max_new_tokens + cache),
                      guard.device_memory(device), f"the {device.type} device",
                      "lower --num-samples or --max-new-tokens")
    prompt = tok.encode(args.prompt)
    if not prompt:
        raise QkvlabError("the prompt encodes to no tokens: pass a non-empty --prompt")
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)
    # fp32 sampling: cheap at this size, and no dtype mixing between the KV cache and autocast
    out = generate(model, idx, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   stop_token=args.stop_token, use_cache=not args.no_cache,
                   compile=args.compile)
    texts = []
    for row in out.tolist():
        # a padded model vocab (e.g. 50304) may emit ids the tokenizer lacks: drop them
        texts.append(tok.decode([i for i in row if i < tok.vocab_size]))
    print("\n---\n".join(texts))
    return 0
