"""`qkvlab eval PATH --lm-eval TASKS`: EleutherAI's lm-evaluation-harness on an exported model.

PATH is a qkvlab run/checkpoint folder (exported to a temporary transformers folder first) or a
folder written by `qkvlab export`. lm-eval is optional and its task data comes from the Hugging
Face hub (or a local datasets cache); when either is missing the command says so on one line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from qkvlab.errors import QkvlabError
from qkvlab.hf.export import export_checkpoint, transformers_available
from qkvlab.run.layout import is_checkpoint_dir

INSTALL_HINT = ("`pip install lm-eval`; its task data is downloaded from the Hugging Face hub "
                "(or read from a local datasets cache with HF_DATASETS_OFFLINE=1)")


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in str(text).split(",") if t.strip()]
    if not tasks:
        raise QkvlabError("--lm-eval needs task names, e.g. --lm-eval hellaswag,lambada_openai")
    return tasks


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not is_checkpoint_dir(path)


def _has_hf_tokenizer(path: Path) -> bool:
    return any((path / n).is_file() for n in ("tokenizer.json", "vocab.json",
                                              "tokenizer_config.json"))


def run_lm_eval(model_dir: Path, tasks: list[str], *, limit: int | None = None,
                batch_size: int = 8, device: str = "cpu") -> dict[str, Any]:
    """lm_eval.simple_evaluate with the `hf` backend on a transformers folder."""
    import lm_eval

    try:
        return lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={model_dir},dtype=float32", tasks=tasks,
            batch_size=batch_size, device=device, limit=limit)
    except (OSError, ConnectionError, ValueError, KeyError) as exc:
        # unknown task names, or task data that cannot be fetched (no hub access)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QkvlabError(f"lm-eval could not run {','.join(tasks)} ({first[:200]}): check the "
                          "task names (`lm-eval ls tasks`) and that the task data is available "
                          "(hub access, or a local datasets cache)") from None


def format_results(results: dict[str, Any]) -> str:
    """lm-eval's own table when it has one, else the per-task metrics as JSON."""
    try:
        from lm_eval.utils import make_table

        return make_table(results)
    except (ImportError, KeyError, TypeError, AttributeError):
        return json.dumps(results.get("results", results), indent=1, default=str)


def evaluate_tasks(path: Path, tasks: list[str], *, limit: int | None = None,
                   batch_size: int = 8) -> dict[str, Any]:
    """lm-eval's results for `tasks` on PATH: a transformers folder, or a qkvlab run or
    checkpoint exported to a temporary one first."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise QkvlabError(f"lm-eval is not installed: {INSTALL_HINT}") from None
    if not transformers_available():
        raise QkvlabError("lm-eval's hf backend needs transformers: pip install 'qkvlab[hf]'")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="qkvlab-lm-eval-") as tmp:
        if _is_hf_dir(path):
            model_dir = path
        else:
            result = export_checkpoint(path, Path(tmp) / "model", verify=False)
            model_dir = result.out
            print(f"exported {path} to a temporary transformers folder ({result.scheme_note})")
        if not _has_hf_tokenizer(model_dir):
            raise QkvlabError(f"lm-eval needs a Hugging Face tokenizer and {path} has none "
                              "(char/bytes tokenizers have no standard equivalent): evaluate a "
                              "model trained with the gpt2 or bpe:N tokenizer")
        return run_lm_eval(model_dir, tasks, limit=limit, batch_size=batch_size, device=device)
