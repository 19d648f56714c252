"""Command line: argument parsing only. Each command's work lives in its own module.

Handlers are imported lazily so `qkvlab --help` stays fast and a command's heavy imports
(matplotlib, tokenizers) cost nothing for the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from qkvlab.errors import QkvlabError


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`qkvlab train: error: ...`), exit code 2.

    Subcommand parsers are made with the class of their parent, so this covers all of them.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} "
                     f"(see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse reports unknown options from the top parser ("qkvlab: error: ..."); name
        # the subcommand they were given to instead
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = next((a.choices.get(getattr(ns, "command", None)) for a in self._actions
                        if isinstance(a, argparse._SubParsersAction)), None)
            (sub or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=1e-3 (repeatable; "
                        "values are TOML literals)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    p.add_argument("--lm-eval", default=None, metavar="TASKS",
                   help="run lm-evaluation-harness tasks (comma-separated) on the model exported "
                        "to transformers instead; PATH may also be a `qkvlab export` folder")
    p.add_argument("--lm-eval-limit", type=int, default=None, metavar="N",
                   help="with --lm-eval: at most N examples per task")
    p.add_argument("--lm-eval-batch-size", type=int, default=None, metavar="B",
                   help="with --lm-eval: batch size (default 8)")
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
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model first: seconds up front, faster per token")
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
                   help="torch.compile the models, training and inference (default: on for CUDA, "
                        "off for CPU)")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, keep freed memory in glibc's heap as `qkvlab train` does, so "
                        "steps do not page-fault (--no-keep-freed-memory: glibc's defaults)")
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

    p = sub.add_parser("export", help="export a checkpoint as a transformers (GPT-2) model folder")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("out_dir", help="folder to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--format", default="hf", choices=["hf"],
                   help="hf: a transformers GPT2LMHeadModel folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the exported weights")
    p.add_argument("--no-verify", action="store_true",
                   help="skip loading the export with transformers to compare logits")
    p.set_defaults(handler="qkvlab.hf.export:export_command")

    p = sub.add_parser("import-hf", help="import a local GPT-2 transformers folder as a checkpoint")
    p.add_argument("model_dir", help="folder with config.json and model.safetensors")
    p.add_argument("--out", default=None, help="checkpoint folder to write (default runs/hf-NAME)")
    p.add_argument("--data", default=None,
                   help="prepared data folder for eval (its tokenizer must match the model's)")
    p.add_argument("--no-detect", action="store_true",
                   help="import as a plain baseline even when a Q/K/V block is exactly c I")
    p.add_argument("--no-verify", action="store_true",
                   help="skip comparing logits with transformers")
    p.set_defaults(handler="qkvlab.hf.importer:import_command")

    p = sub.add_parser("retrofit",
                       help="turn a trained standard model into W_Q = I: convert, then heal")
    p.add_argument("path", help="run folder or checkpoint folder of a baseline model")
    p.add_argument("--to", default="q-identity", choices=["q-identity"],
                   help="target scheme (only q-identity)")
    p.add_argument("--init", default="regress", choices=["regress", "basis", "drop"],
                   help="regress: per-head least-squares query absorbed into W_K (default); "
                        "basis: theory's best available conversion; drop: just remove W_Q")
    p.add_argument("--steps", type=int, default=200, help="healing steps (0: convert only)")
    p.add_argument("--distill", action="store_true",
                   help="heal by distillation (KL to the original model's logits), not plain CE")
    p.add_argument("--lr", type=float, default=None,
                   help="healing peak learning rate (default: the run's min_lr x 3)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="healing batch size (default: the run's)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validation interval in steps (default: steps / 4)")
    p.add_argument("--windows", type=int, default=None,
                   help="validation windows (default: the run's eval_windows, at most 64)")
    p.add_argument("--calib-batches", type=int, default=8,
                   help="training batches whose activations fit the regress init")
    p.add_argument("--compare-inits", action="store_true",
                   help="also report every init's loss right after conversion")
    p.add_argument("--seed", type=int, default=0, help="seed of the healing batches")
    p.add_argument("--out", default=None,
                   help="checkpoint folder to write (default RUN/retrofit-q-identity)")
    p.add_argument("--data", default=None, help="prepared data folder (default: the run's)")
    p.set_defaults(handler="qkvlab.retrofit.command:retrofit_command")

    p = sub.add_parser("sweep", help="train an experiment spec: variants x seeds, resumable")
    p.add_argument("spec", nargs="?", default=None,
                   help="shipped spec name, spec TOML file, or a sweep folder to continue; "
                        "without it, list the shipped specs")
    p.add_argument("--out", default=None, help="sweep folder (default runs/sweeps/SPEC)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs, their state, parameter counts and tokens; train nothing")
    p.add_argument("--print-commands", action="store_true",
                   help="print one self-contained command per pending run (for a scheduler)")
    p.add_argument("--launcher", default=None,
                   help="start each run as LAUNCHER -m qkvlab train RUN --resume, e.g. "
                        "'torchrun --standalone --nproc-per-node=8'")
    p.add_argument("--only", action="append", default=None, metavar="VARIANT",
                   help="only these variants (repeatable or comma-separated)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds instead of the spec's")
    p.add_argument("--yes", action="store_true", help="allow launching more than 100 runs")
    p.add_argument("--retry-failed", action="store_true", help="retrain runs that failed before")
    p.add_argument("--reuse", action="append", default=None, metavar="SWEEP_DIR",
                   help="copy finished runs with the same config and seed from this other "
                        "sweep folder instead of training them (repeatable)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="train N runs at once, the cores split between them (default 1)")
    _overrides(p)
    p.set_defaults(handler="qkvlab.experiments.sweep:sweep_command")

    p = sub.add_parser("report", help="Markdown report and plots of a sweep: paired statistics")
    p.add_argument("spec_or_dir", help="sweep folder, or a spec (its runs in --runs or the "
                                       "spec's default folder)")
    p.add_argument("--runs", default=None, help="sweep folder when a spec is given")
    p.add_argument("--out", default=None, help="report folder (default SWEEP/report)")
    p.add_argument("--per-window", action="store_true",
                   help="also score each final checkpoint per validation window (secondary "
                        "paired view; loads the checkpoints)")
    p.add_argument("--versus", default=None, metavar="VARIANT",
                   help="pair every variant against this one instead of the spec's baseline "
                        "(e.g. nonlinear-q vs a wider-MLP control)")
    _overrides(p)
    p.set_defaults(handler="qkvlab.experiments.report:report_command")

    p = sub.add_parser("archive", help="copy a sweep's records without its checkpoints "
                                       "(to commit results)")
    p.add_argument("sweep_dir", help="the sweep folder")
    p.add_argument("dest", help="where the copy goes (created; existing records are replaced)")
    p.set_defaults(handler="qkvlab.experiments.archive:archive_command")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    module_name, func_name = args.handler.split(":")
    try:
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except QkvlabError as err:
        # one line whatever the message quotes (a key or path may hold a newline)
        print(f"qkvlab {args.command}: error: {' '.join(str(err).splitlines())}",
              file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # output piped into `head` and the like
        return 0
    except KeyboardInterrupt:
        print(f"qkvlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
