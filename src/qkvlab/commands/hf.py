"""`qkvlab export` and `qkvlab import-hf`: checkpoints to and from transformers folders
(GPT2LMHeadModel, or LlamaForCausalLM for Llama-style models)."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.commands.common import Subparsers, register


# ---- export --------------------------------------------------------------------------------
@dataclass
class ExportOptions:
    path: str
    out_dir: str
    format: str = "hf"
    dtype: str = "float32"
    no_verify: bool = False


def run_export(opts: ExportOptions) -> int:
    """Export, then print where, what was written, and the verified logit difference."""
    from qkvlab.hf.export import export_checkpoint

    result = export_checkpoint(opts.path, opts.out_dir, fmt=opts.format, dtype=opts.dtype,
                               verify=not opts.no_verify)
    print(f"exported {opts.path} -> {result.out} (transformers {result.architecture}, "
          f"{opts.dtype})")
    print(f"  {result.scheme_note}")
    print(f"  tokenizer: {result.tokenizer_note}")
    print(f"  files: {', '.join(result.files)}")
    if result.max_logit_diff is None:
        why = "--no-verify" if opts.no_verify else "transformers is not installed"
        print(f"  not verified ({why}); load with "
              f"AutoModelForCausalLM.from_pretrained({str(result.out)!r})")
    elif opts.dtype == "float32":  # a larger difference is refused before anything is written
        print(f"  verified with transformers: max |logit diff| {result.max_logit_diff:.2e}")
    else:
        print(f"  compared with transformers: max |logit diff| {result.max_logit_diff:.2e} "
              f"({opts.dtype} rounds factors folded into the weights; float32 is exact)")
    return 0


# ---- import-hf -----------------------------------------------------------------------------
@dataclass
class ImportOptions:
    model_dir: str
    out: str | None = None
    data: str | None = None
    no_detect: bool = False
    no_verify: bool = False


def run_import(opts: ImportOptions) -> int:
    """Import, then print what was read and the verified logit difference."""
    from qkvlab.hf.importer import import_model_dir
    from qkvlab.model.params import count_params

    result = import_model_dir(opts.model_dir, opts.out, detect=not opts.no_detect,
                              data_dir=opts.data, verify=not opts.no_verify)
    cfg = result.model.cfg
    heads = f"{cfg.n_head} heads" if cfg.kv_heads == cfg.n_head else \
        f"{cfg.n_head} heads ({cfg.kv_heads} key/value)"
    print(f"imported {opts.model_dir} -> {result.out} ({result.architecture}: {cfg.n_layer} "
          f"layers x {cfg.n_embd}, {heads}, vocab {cfg.vocab_size}, context {cfg.block_size}, "
          f"projection={cfg.projection}, {count_params(cfg).total:,} parameters)")
    for note in result.notes:
        print(f"  note: {note}")
    print(f"  tokenizer: {result.tokenizer_note}")
    if result.max_logit_diff is None:
        why = "--no-verify" if opts.no_verify else "transformers is not installed"
        print(f"  not verified against transformers ({why})")
    else:
        print(f"  verified with transformers: max |logit diff| {result.max_logit_diff:.2e}")
    return 0


# ---- registration --------------------------------------------------------------------------
def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("export",
                       help="export a checkpoint as a transformers (GPT-2 or Llama) model folder")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("out_dir", help="folder to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--format", choices=["hf"],
                   help="hf: a transformers LlamaForCausalLM folder for a Llama-style model "
                        "(RMSNorm, RoPE, SwiGLU), else a GPT2LMHeadModel folder")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the exported weights")
    p.add_argument("--no-verify", action="store_true",
                   help="skip loading the export with transformers to compare logits "
                        "(by default an export whose logits differ is not written)")
    register(p, ExportOptions, run_export)

    p = sub.add_parser("import-hf",
                       help="import a local GPT-2 or Llama transformers folder as a checkpoint")
    p.add_argument("model_dir", help="folder with config.json and model.safetensors "
                   "(GPT2LMHeadModel or LlamaForCausalLM)")
    p.add_argument("--out", help="checkpoint folder to write (default runs/hf-NAME)")
    p.add_argument("--data",
                   help="prepared data folder for eval (its tokenizer must match the model's)")
    p.add_argument("--no-detect", action="store_true",
                   help="import as a plain baseline even when a Q/K/V block is exactly c I")
    p.add_argument("--no-verify", action="store_true",
                   help="skip comparing logits with transformers (by default an import whose "
                        "logits differ is refused and nothing is written)")
    register(p, ImportOptions, run_import)
