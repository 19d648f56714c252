"""Small crash-safe file helpers: atomic writes, directory fsyncs, file hashes, and the check
of the folder a new checkpoint is written to.

Shared by the data cache, prepared datasets, run configs, metrics and checkpoints, so every
file qkvlab writes is either complete or absent.

The folders qkvlab writes into or copies out of (run folders, checkpoints, exports, sweeps)
hold their own files: a symbolic link that leads out of the folder is refused (`check_inside`,
`check_tree`) before anything is written, and copies read through `read_inside` /
`read_tree_inside`, so nothing outside is ever overwritten or copied in. A link that stays
inside its folder is harmless (an atomic write replaces the link itself) and is allowed.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

from qkvlab.errors import QkvlabError


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


def umask() -> int:
    """The process's umask. Linux shows it in /proc; elsewhere os.umask, which can only be read
    by setting it, is set back at once."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a file another library wrote the mode qkvlab's own files get (0666 less the umask):
    safetensors' save_file leaves 0600, which other users of a shared folder cannot read."""
    os.chmod(path, 0o666 & ~umask())


def can_write(folder: Path) -> bool:
    """This process may create files in `folder` (asked of the OS: root may where modes say
    no, another user may not where they say yes)."""
    return os.access(folder, os.W_OK | os.X_OK)


def fsync_file(path: Path) -> None:
    """fsync a file that was written by someone else (e.g. safetensors.save_file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- links out of a folder ----------------------------------------------------------------
def check_inside(folder: Path, path: Path) -> None:
    """Refuse `path` (a path in `folder`) when it, or a folder on the way to it, is a symbolic
    link whose target lies outside `folder`: writing or copying it would touch that target."""
    folder, path = Path(folder), Path(path)
    try:
        root, target = folder.resolve(), path.resolve()
    except (OSError, RuntimeError):  # a link loop: it leads nowhere inside either
        target = None
    if target is not None and target.is_relative_to(root):
        return
    where = f"to {target}" if target is not None else "in a loop"
    raise QkvlabError(f"{path} leads {where} through a symbolic link, outside {folder}: qkvlab "
                      "writes and copies only the folder's own files; replace the link with "
                      "a regular file or folder")


def check_tree(folder: Path, root: Path | None = None) -> None:
    """`check_inside(root, ...)` for `folder` and every symbolic link in it and below (no link
    is followed); `root` defaults to `folder`. A folder that does not exist yet holds none."""
    folder = Path(folder)
    root = folder if root is None else Path(root)
    check_inside(root, folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            entry = Path(dirpath) / name
            if entry.is_symlink():
                check_inside(root, entry)


def read_inside(folder: Path, path: Path) -> bytes:
    """The bytes of `path` for a copy, refused when a link takes it out of `folder`."""
    check_inside(folder, path)
    return Path(path).read_bytes()


def read_tree_inside(folder: Path, src: Path) -> dict[str, bytes]:
    """Every file under `src` (a folder in `folder`) by its relative path, for a copy; all
    checked before any is read, so a refused copy has read (and written) nothing."""
    src = Path(src)
    check_tree(src, folder)
    return {p.relative_to(src).as_posix(): p.read_bytes()
            for p in sorted(src.rglob("*")) if p.is_file()}


# ---- paths as records store them ----------------------------------------------------------
# A record (summary.json, config.toml, sweep.json, report.json) is read in a clone or on another
# machine, where an absolute path of the machine that wrote it means nothing and shows that
# machine's layout: records keep paths relative to their own folder, or just a name.

def portable(path: str | Path, base: str | Path | None = None) -> str:
    """`path` as a record stores it: a relative path as given; an absolute one relative to
    `base` (the record's folder) when it lies inside it, else only its last component."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        return str(path)
    if base is not None:
        root = Path(base).expanduser().resolve()
        if p.resolve().is_relative_to(root):
            return str(p.resolve().relative_to(root)) or "."
    return p.name


def portable_command(line: str) -> str:
    """A recorded command line with each absolute path (a word, or the value of key=value)
    reduced to its last component, the way a user would retype it from its folder."""
    import shlex  # only the few commands that record a command line need it

    def word(w: str) -> str:
        key, eq, value = w.partition("=")
        if eq and Path(value).expanduser().is_absolute():
            return f"{key}={portable(value)}"
        return portable(w) if Path(w).expanduser().is_absolute() else w

    return shlex.join(word(w) for w in shlex.split(line))

