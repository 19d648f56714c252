"""Command line: the top parser, and a verb's parsed arguments turned into its options.

Each verb is registered by its module in qkvlab.commands; those modules import the libraries
only when a verb runs, so `qkvlab --help` stays fast and a command's heavy imports
(matplotlib, tokenizers) cost nothing for the others.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from qkvlab import __version__, interrupts
from qkvlab.commands import (
    archive,
    bench,
    compare,
    coordcheck,
    hf,
    params,
    prepare,
    presets,
    report,
    retrofit,
    sweep,
    theory,
    train,
)
from qkvlab.errors import QkvlabError

# in the order `qkvlab --help` lists the verbs
COMMAND_MODULES = (prepare, train, params, coordcheck, compare, presets, bench, theory, hf,
                   retrofit, sweep, report, archive)
# what argparse adds beside the verb's own options (see qkvlab.commands.common.register)
_NOT_OPTIONS = ("command", "options", "run", "trains")


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qkvlab",
        description="Attention without a redundant W_Q: models, training, theory, experiments.",
    )
    parser.add_argument("--version", action="version", version=f"qkvlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def options_from(args: argparse.Namespace) -> Any:
    """The verb's options dataclass, its fields taken from the parsed arguments."""
    return args.options(**{k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS})


def main(argv: list[str] | None = None) -> int:
    with interrupts.deferred():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    try:
        _load_for(args)
        return int(args.run(options_from(args)) or 0)
    except QkvlabError as err:
        # one line whatever the message quotes (a key or path may hold a newline)
        print(f"qkvlab {args.command}: error: {' '.join(str(err).splitlines())}",
              file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # output piped into `head` and the like
        return 0
    except interrupts.Interrupted as stop:
        print(f"qkvlab {args.command}: stopped by signal {stop.signum}{_resume_hint()}",
              file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print(f"qkvlab {args.command}: interrupted{_resume_hint()}", file=sys.stderr)
        return 130


def _load_for(args: argparse.Namespace) -> None:
    """A verb that trains loads torch while a stop signal waits (it arms them itself, see
    qkvlab.interrupts); the others get the usual handlers now."""
    if getattr(args, "trains", False):
        import qkvlab.train  # noqa: F401 - torch's C start-up must not see a KeyboardInterrupt
    else:
        interrupts.release()


def _resume_hint() -> str:
    resume = interrupts.resume_command()
    return f"; resume with: {resume}" if resume else ""


if __name__ == "__main__":
    raise SystemExit(main())
