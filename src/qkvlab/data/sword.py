"""A SWORD Bible module (zText driver, zlib blocks, OSIS markup) as plain prose.

zText keeps each testament in three files: `.bzs` lists the compressed blocks (offset, size,
uncompressed size; uint32 each), `.bzz` holds the blocks, and `.bzv` locates every verse
(block, offset, size as uint32, uint32, uint16) inside its uncompressed block. A block is one
book, which becomes one document. The OSIS markup is reduced to text: footnotes dropped (with
a space where the text ran on after one), titles, paragraphs and poetry lines on lines of their
own, Strong's-number word tags and every other tag removed, XML entities decoded, NFC.
"""

from __future__ import annotations

import html
import re
import struct
import unicodedata
import zlib

from qkvlab.errors import QkvlabError, require

TESTAMENTS = ("ot", "nt")
_BLOCK = struct.Struct("<III")
_VERSE = struct.Struct("<IIH")

_NOTE = re.compile(r"<note\b[^<]*(?:<(?!/note>)[^<]*)*</note>")  # one note, never two
# The text runs on after a footnote without a space ("God<note>..</note><w>created"): add one.
_NOTE_BEFORE_WORD = re.compile(_NOTE.pattern + r"(?=(?:<[^>]*>)*\w)")
# A new line where a title, paragraph, poetry line or line break starts or ends.
_BREAK = re.compile(r"<(?:title\b[^>]*|/title|div\b[^>]*type=\"x-p\"[^>]*|l\b[^>]*|lb\b[^>]*)>")
_TAG = re.compile(r"<[^>]*>")


def _records(data: bytes, layout: struct.Struct, origin: str) -> list[tuple[int, ...]]:
    require(len(data) % layout.size == 0, f"{origin} is not a zText index: give the pinned package")
    return [layout.unpack_from(data, pos) for pos in range(0, len(data), layout.size)]


def _blocks(bzs: bytes, bzz: bytes, origin: str) -> list[bytes]:
    blocks = []
    for offset, size, _ in _records(bzs, _BLOCK, origin + ".bzs"):
        try:
            blocks.append(zlib.decompress(bzz[offset : offset + size]))
        except zlib.error as exc:
            raise QkvlabError(f"{origin}.bzz has a bad block at {offset} ({exc}): "
                              "give the pinned package") from exc
    return blocks


def osis_to_text(osis: str) -> str:
    """OSIS as plain text: a line per title, paragraph or poetry line; ends in a blank line."""
    text = _NOTE.sub("", _NOTE_BEFORE_WORD.sub(" ", osis))
    text = _BREAK.sub("\n", text)
    text = html.unescape(_TAG.sub("", text))
    lines = [" ".join(line.split()) for line in text.splitlines()]
    body = "\n".join(line for line in lines if line)
    return unicodedata.normalize("NFC", body + "\n\n") if body else ""


def ztext_books(bzs: bytes, bzz: bytes, bzv: bytes, origin: str) -> list[str]:
    """The books of one testament (one per block, verses joined by spaces), cleaned."""
    blocks = _blocks(bzs, bzz, origin)
    verses: list[list[str]] = [[] for _ in blocks]
    for block, offset, size in _records(bzv, _VERSE, origin + ".bzv"):
        if size == 0:
            continue  # a verse this versification has but this text lacks
        require(block < len(blocks) and offset + size <= len(blocks[block]),
                f"{origin}.bzv points outside its blocks: give the pinned package")
        verses[block].append(blocks[block][offset : offset + size].decode("utf-8", "replace"))
    docs = [osis_to_text(" ".join(parts)) for parts in verses]
    return [doc for doc in docs if doc]
