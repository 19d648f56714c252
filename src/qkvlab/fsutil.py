"""Small crash-safe file helpers: atomic writes, directory fsyncs, file hashes, and the check
of the folder a new checkpoint is written to.

Shared by the data cache, prepared datasets, run configs, metrics and checkpoints, so every
file qkvlab writes is either complete or absent.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so large files need little memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def temp_sibling(path: Path) -> Path:
    """A fresh temporary name `.NAME.PID.HEX.tmp` next to `path` (same filesystem, so
    os.replace is atomic). Unlike mkstemp's 0600 files, it gets the usual umask permissions."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or a new file) to disk; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows cannot open directories
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write via a temp file in the same folder, fsync, then os.replace: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """`write_bytes_atomic` for UTF-8 text."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def fsync_file(path: Path) -> None:
    """fsync a file that was written by someone else (e.g. safetensors.save_file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
