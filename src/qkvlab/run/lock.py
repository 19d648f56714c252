"""The run folder's lock: one process trains in a folder at a time."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.run.layout import LOCK_FILE


class RunInUse(QkvlabError):
    """The run folder is locked by a live process: it is being trained now."""


class RunLock:
    """An exclusive lock file (pid, host, process start time) so two runs never share a folder.

    A lock whose process is dead (SIGKILL, power cut) is taken over; the start time tells a
    recycled pid from the process that wrote the lock. The check-and-create runs under an
    flock of the run folder, so two runs racing for a stale lock cannot both win. A run folder
    this lock had to create is removed again on exit if nothing was written into it.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.token = f"{os.getpid()} {socket.gethostname()} {_start_time(os.getpid()) or '-'}"
        self._created: list[Path] = []  # folders mkdir made, deepest first

    def __enter__(self) -> RunLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise QkvlabError(f"run dir {self.run_dir} is a file, not a folder: choose another "
                              "--out")
        missing = self.run_dir
        while not missing.exists() and missing != missing.parent:
            self._created.append(missing)
            missing = missing.parent
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with _dir_mutex(self.run_dir):
                self._acquire()
        except OSError as exc:
            self._remove_created()
            raise QkvlabError(f"cannot lock run dir {self.run_dir} "
                              f"({exc.strerror or exc}): choose another --out") from None
        except BaseException:
            self._remove_created()
            raise
        return self

    def _acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _live_holder(self.path)
                if holder:
                    raise RunInUse(
                        f"run dir {self.run_dir} is in use by {holder} (lock file "
                        f"{self.path}): wait for it, or delete the lock file if that process "
                        "is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process is dead
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.token + "\n")
            return
        raise QkvlabError(f"cannot take the lock {self.path}: another run keeps replacing it")

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()  # only if empty: never delete what someone wrote
            except OSError:
                break

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.path.read_text(encoding="utf-8").strip() == self.token:
                self.path.unlink()
        except OSError:
            pass
        self._remove_created()


def lock_holder(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock ("process PID on HOST") while that process lives, else None."""
    return _live_holder(Path(run_dir) / LOCK_FILE)


def _live_holder(path: Path) -> str | None:
    try:
        fields_ = path.read_text(encoding="utf-8").split()
        pid, host = int(fields_[0]), fields_[1]
        started = fields_[2] if len(fields_) > 2 else "-"
    except (OSError, ValueError, IndexError):
        return None  # no lock, or an empty or garbled one: its writer died writing it
    return f"process {pid} on {host}" if pid > 0 and _alive(pid, host, started) else None


def _alive(pid: int, host: str, started: str = "-") -> bool:
    if host != socket.gethostname():
        return True  # cannot check another machine: assume it is running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _start_time(pid)
    # the pid is taken, but by a process started after the lock's writer: pid reuse
    return started == "-" or now is None or now == started


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _dir_mutex(folder: Path):
    """flock a folder for a moment (POSIX); a no-op where folders cannot be flocked."""
    try:
        import fcntl  # POSIX only: elsewhere the ImportError below makes this a no-op
    except ImportError:  # Windows
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. a network file system without flock: the O_EXCL create still guards
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
