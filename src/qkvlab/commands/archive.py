"""`qkvlab archive`: copy a sweep's records without its checkpoints (to commit results)."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.commands.common import Subparsers, check_output_folder, register


@dataclass
class ArchiveOptions:
    sweep_dir: str
    dest: str
    finished: bool = False
    no_attention: bool = False


def run_archive(opts: ArchiveOptions) -> int:
    """Copy the records and say how many runs they cover."""
    from pathlib import Path

    from qkvlab.experiments.archive import archive_sweep

    src, dest = Path(opts.sweep_dir), Path(opts.dest)
    check_output_folder(dest, "DEST")
    n, left = archive_sweep(src, dest, finished_only=opts.finished,
                            attention=not opts.no_attention)
    print(f"copied the records of {n} runs from {src} to {dest} (no checkpoints)"
          + (f"; left out {left} unfinished run(s)" if left else ""))
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("archive", help="copy a sweep's records without its checkpoints "
                                       "(to commit results)")
    p.add_argument("sweep_dir", help="the sweep folder")
    p.add_argument("dest", help="where the copy goes (created; existing records are replaced)")
    p.add_argument("--finished", action="store_true",
                   help="copy only the runs that trained all their steps (archive a sweep "
                        "that is still training)")
    p.add_argument("--no-attention", action="store_true",
                   help="do not measure each finished run's attention from its final "
                        "checkpoint first (by default it is, so that `qkvlab report "
                        "--attention` of the archive shows every run)")
    register(p, ArchiveOptions, run_archive)
