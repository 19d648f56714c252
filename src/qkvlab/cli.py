"""Command line: argument parsing only. Each command's work lives in its own module.

Handlers are imported lazily so `qkvlab --help` stays fast and a command's heavy imports
(matplotlib, tokenizers) cost nothing for the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from qkvlab.errors import QkvlabError


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=1e-3 (repeatable; "
                        "values are TOML literals)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkvlab",
        description="Attention without a redundant W_Q: models, training, theory, experiments.",
    )
    from qkvlab import __version__

    parser.add_argument("--version", action="version", version=f"qkvlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token files")
    p.add_argument("source", nargs="?", default="shakespeare",
                   help="shakespeare (embedded default), a text file, a folder, a .jsonl file, "
                        "or a Hugging Face dataset name (hf:NAME)")
    p.add_argument("--tokenizer", default="char", help="char | bytes | gpt2 | bpe:N")
    p.add_argument("--out", default=None, help="output folder (default data/SOURCE-TOKENIZER)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="held-out share (default 0.1; 0.0005 for Hugging Face datasets)")
    p.add_argument("--text-field", default="text", help="field holding the text (.jsonl, datasets)")
    p.add_argument("--num-proc", type=int, default=1, help="worker processes (datasets only)")
    p.add_argument("--force", action="store_true", help="overwrite a different prepared folder")
    p.set_defaults(handler="qkvlab.data.prepare:prepare_command")

    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", help="TOML config file, or a preset name (see `qkvlab presets`)")
    p.add_argument("--out", default=None, help="run folder (overrides run.out_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    _overrides(p)
    p.set_defaults(handler="qkvlab.train.commands:train_command")

    p = sub.add_parser("eval", help="validation loss of a run or checkpoint")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("--windows", type=int, default=None, help="number of validation windows")
    p.add_argument("--data", default=None, help="prepared data folder (default: the run's)")
    p.set_defaults(handler="qkvlab.train.commands:eval_command")

    p = sub.add_parser("sample", help="generate text from a run or checkpoint")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--stop-token", type=int, default=None)
    p.add_argument("--no-cache", action="store_true", help="recompute the prefix every token")
    p.set_defaults(handler="qkvlab.train.commands:sample_command")

    p = sub.add_parser("params", help="parameter accounting of a config or the paper's variants")
    p.add_argument("config", nargs="?", default=None,
                   help="TOML config or preset; default: the five GPT-2-small variants of the "
                        "paper")
    p.add_argument("--untied", action="store_true", help="count an untied output head")
    p.add_argument("--json", action="store_true", help="print JSON")
    _overrides(p)
    p.set_defaults(handler="qkvlab.experiments.params_table:params_command")

    p = sub.add_parser("compare", help="the main job: baseline vs W_Q = I vs W_Q = I + wider MLP")
    p.add_argument("--preset", default="quick", help="quick (~10 min on 2 cores) | long")
    p.add_argument("--out", default="runs/compare", help="folder for the runs, table and plot")
    p.add_argument("--steps", type=int, default=None, help="override the number of steps")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="retrain runs that already finished")
    _overrides(p)
    p.set_defaults(handler="qkvlab.experiments.compare:compare_command")

    p = sub.add_parser("presets", help="list the shipped config presets")
    p.set_defaults(handler="qkvlab.train.config:presets_command")

    p = sub.add_parser("bench", help="training and inference speed of the projection schemes")
    p.add_argument("--shape", default="baby",
                   help="baby (6x384, ctx 256) | paper (12x768, ctx 1024) | tiny (tests)")
    p.add_argument("--schemes", default="baseline,q-identity",
                   help="comma-separated variants: baseline, q-identity, q-identity-wide, "
                        "nonlinear-q")
    p.add_argument("--batch-size", type=int, default=None,
                   help="training batch (default: the shape's, larger on CUDA)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (medians)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per scheme first")
    p.add_argument("--dtype", default="bf16", help="bf16 (autocast) | fp32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training models (default: on for CUDA, off for CPU)")
    p.add_argument("--no-inference", action="store_true", help="skip prefill/decode timings")
    p.add_argument("--infer-batch-size", type=int, default=1, help="sequences decoded at once")
    p.add_argument("--contexts", default=None,
                   help="comma-separated inference context lengths (default: the shape's)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="decoding steps timed per context (default: the shape's)")
    p.add_argument("--gen-tokens", type=int, default=None,
                   help="new tokens for generate() with vs without the cache (0 skips; "
                        "default 512, 40 for tiny)")
    p.add_argument("--gen-repeats", type=int, default=1,
                   help="repeats of the (slow, uncached) generate() comparison")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="MFU denominator in TFLOP/s (default: GPU datasheet, else measured)")
    p.add_argument("--json", default=None, help="also write results as JSON to this file")
    _overrides(p)
    p.set_defaults(handler="qkvlab.bench.run:bench_command")

    p = sub.add_parser("verify", help="check the paper's theorems numerically (float64)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler="qkvlab.theory.verify:verify_command")

    p = sub.add_parser("convert", help="convert a checkpoint exactly to an identity projection")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("--to", default="q-identity", help="q-identity | k-identity | v-identity")
    p.add_argument("--out", default=None, help="folder for the converted checkpoint")
    p.set_defaults(handler="qkvlab.theory.convert_cmd:convert_command")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module_name, func_name = args.handler.split(":")
    try:
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except QkvlabError as err:
        print(f"qkvlab {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # output piped into `head` and the like
        return 0
    except KeyboardInterrupt:
        print(f"qkvlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
