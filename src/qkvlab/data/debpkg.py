"""Read files out of a Debian package (.deb) without dpkg.

A .deb is an `ar` archive whose `data.tar.*` member holds the installed files; Python's tarfile
reads the xz, gzip and bzip2 compressions Debian uses, so no tool outside Python is needed.
"""

from __future__ import annotations

import io
import lzma
import tarfile
import zlib
from pathlib import Path

from qkvlab.errors import QkvlabError, require

AR_MAGIC = b"!<arch>\n"
AR_HEADER = 60  # name 16, mtime 12, uid 6, gid 6, mode 8, size 10, "`\n" 2


def ar_members(data: bytes, origin: str) -> dict[str, bytes]:
    """The members of an `ar` archive, by name."""
    require(data.startswith(AR_MAGIC), f"{origin} is not a Debian package (no ar header): "
            "give the pinned .deb file")
    members, pos = {}, len(AR_MAGIC)
    while pos + AR_HEADER <= len(data):
        header = data[pos : pos + AR_HEADER]
        size_field = header[48:58].strip()
        require(header[58:60] == b"`\n" and size_field.isdigit(),
                f"{origin} has a broken ar header at byte {pos}: give the pinned .deb file")
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size, start = int(size_field), pos + AR_HEADER
        require(start + size <= len(data), f"{origin} is truncated: give the pinned .deb file")
        members[name] = data[start : start + size]
        pos = start + size + (size % 2)  # members are padded to an even offset
    return members


def deb_files(deb: Path, paths: tuple[str, ...]) -> dict[str, bytes]:
    """The contents of `paths` (e.g. "usr/share/dictd/gcide.index") inside the package `deb`."""
    members = ar_members(deb.read_bytes(), str(deb))
    data_tar = [name for name in members if name.startswith("data.tar")]
    require(len(data_tar) == 1, f"{deb} has no data.tar member: give the pinned .deb file")
    try:
        with tarfile.open(fileobj=io.BytesIO(members[data_tar[0]]), mode="r:*") as tar:
            wanted = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
            missing = [p for p in paths if p not in wanted]
            require(not missing, f"{deb} lacks {', '.join(missing)}: give the pinned .deb file")
            return {p: tar.extractfile(wanted[p]).read() for p in paths}  # type: ignore[union-attr]
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, zlib.error) as exc:
        raise QkvlabError(
            f"cannot read {data_tar[0]} in {deb} ({exc}): give the pinned .deb file"
        ) from exc
