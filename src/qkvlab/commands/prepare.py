"""`qkvlab prepare`: tokenize a corpus into train/val token files."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.commands.common import Subparsers, register


@dataclass
class PrepareOptions:
    source: str = "shakespeare"
    tokenizer: str = "char"
    out: str | None = None
    val_fraction: float | None = None
    text_field: str = "text"
    num_proc: int = 1
    force: bool = False


def run_prepare(opts: PrepareOptions) -> int:
    """Prepare the source and print a short summary."""
    from pathlib import Path

    from qkvlab.data.prepare import default_data_dir, prepare

    # an empty argument means the default, as it always has
    source = opts.source or "shakespeare"
    tokenizer = opts.tokenizer or "char"
    out_dir = Path(opts.out) if opts.out is not None else default_data_dir(source, tokenizer)
    meta = prepare(source, tokenizer, out_dir, val_fraction=opts.val_fraction,
                   num_proc=opts.num_proc, overwrite=opts.force,
                   text_field=opts.text_field or "text", log=print)
    print(
        f"prepared {source} with {meta['tokenizer']}: {meta['train_tokens']:,} train + "
        f"{meta['val_tokens']:,} val tokens ({meta['dtype']}, vocab {meta['vocab_size']:,}) "
        f"in {out_dir}"
    )
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token files")
    p.add_argument("source", nargs="?",
                   help="shakespeare (embedded default), english (39M bytes: dictionary "
                        "entries, Wikipedia leads, the Bible; docs/data.md), a text file, a "
                        "folder, a .jsonl file, "
                        "or a Hugging Face dataset name (hf:NAME)")
    p.add_argument("--tokenizer", help="char | bytes | gpt2 | bpe:N")
    p.add_argument("--out", help="output folder (default data/SOURCE-TOKENIZER)")
    p.add_argument("--val-fraction", type=float,
                   help="held-out share (default 0.1; 0.0005 for Hugging Face datasets)")
    p.add_argument("--text-field", help="field holding the text (.jsonl, datasets)")
    p.add_argument("--num-proc", type=int, help="worker processes (datasets only)")
    p.add_argument("--force", action="store_true", help="overwrite a different prepared folder")
    register(p, PrepareOptions, run_prepare)
