"""GCIDE (Webster's 1913 dictionary and its supplements) from its dictd files, as plain prose.

dictd keeps the text in `NAME.dict.dz` (gzip-readable) and one line per headword in
`NAME.index`: headword, offset and length in a base64 alphabet. Every distinct (offset, length)
is one entry, and an entry becomes one document with the markup taken out:

- pronunciations between backslashes (`Coagulate \\Co*ag"u*late\\`) and source tags such as
  `[1913 Webster]` or `[WordNet 1.5 +PJC]` are dropped; `{cross references}` lose their braces;
- the bracketed letter codes (`['e]`, `[=a]`, `[ae]`, `[alpha]`) become Unicode letters;
- wrapped lines are joined, one paragraph (or numbered sense) per line, entries end in a blank
  line; the result is in Unicode NFC.
"""

from __future__ import annotations

import gzip
import re
import unicodedata
import zlib

from qkvlab.errors import QkvlabError, require

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUE = {c: i for i, c in enumerate(_B64)}
INFO_PREFIX = "00-"  # dictd's database-info pseudo entries (name, URL, license notice)

_PRONUNCIATION = re.compile(r"[ \t]*\\[^\\\n]*\\")
_SOURCE = (r"(?:1913 Webster|Webster 1913 Suppl\.|Century Dict\. 1906"
           r"|WordNet(?: \d\.\d| sense \d+)?|PJC\.?|AS|RDH|RHUD|GG|RP)")
_SOURCE_TAG = re.compile(rf"\[\s*{_SOURCE}(?:\s*\+?\s*{_SOURCE})*\s*\]")
_CODE = re.compile(r"\[([^\[\]\s]{1,7})\]")
_MARKED = re.compile(r"^([`'\"^=~,.*-]?)([A-Za-z]{1,2})(\^?)$")
_SENSE = re.compile(r"^(?:\d+\.|\([a-z]\))\s")  # "1. ..." or "(a) ..." starts its own line
_BLANK_LINE = re.compile(r"\n[ \t]*\n")

# Mark -> combining character; "-" (Webster's obscure vowels) keeps the bare letter.
_PREFIX_MARK = {"'": "\u0301", "`": "\u0300", '"': "\u0308", "^": "\u0302", "=": "\u0304",
                "~": "\u0303", ",": "\u0327", ".": "\u0307", "*": "\u030a", "-": ""}
_BREVE = "\u0306"  # a trailing ^, as in [i^]
_LETTERS = {"ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ"}
_NAMED = {
    **_LETTERS, "eth": "ð", "thorn": "þ", "yogh": "ȝ", "root": "√", "deg": "°", "sect": "§",
    "imac": "ī", "aum": "ä", "add": "a", "asl": "a", "udd": "u", "ng": "n", "th": "th",
    "dsdot": "d", "bar": "|", "pounds": "£", "flat": "♭", "sharp": "♯",
}


def b64_number(text: str) -> int:
    """A dictd index number (offset or length) written in its base64 alphabet."""
    value = 0
    for char in text:
        value = value * 64 + _B64_VALUE[char]
    return value


def entry_spans(index: bytes, dict_size: int, origin: str) -> list[tuple[int, int]]:
    """The distinct (offset, length) of every entry in a dictd index, in text order."""
    spans = set()
    for lineno, line in enumerate(index.decode("utf-8", "replace").splitlines(), start=1):
        fields = line.split("\t")
        try:
            offset, length = b64_number(fields[1]), b64_number(fields[2])
        except (IndexError, KeyError):
            raise QkvlabError(f"{origin}:{lineno} is not a dictd index line: "
                              "give the pinned package") from None
        require(offset + length <= dict_size, f"{origin}:{lineno} points past the end of "
                "the dictionary text: give the pinned package")
        if not fields[0].startswith(INFO_PREFIX):
            spans.add((offset, length))
    return sorted(spans)


def _decode(raw: bytes) -> str:
    # GCIDE is ASCII but for a few stray Windows-1252 bytes (0x92 for an apostrophe).
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def _letter(code: str) -> str | None:
    """The Unicode text of one bracketed letter code, or None when it is not one."""
    if code in _NAMED:
        return _NAMED[code]
    marked = _MARKED.match(code)
    if marked is None:
        return _greek(code)
    prefix, base, suffix = marked.groups()
    if not (prefix or suffix):
        return _greek(code)  # "[pi]" is a letter; "[R]" and "[I]" are bracketed words
    mark = _PREFIX_MARK[prefix] if prefix else _BREVE
    base = _LETTERS.get(base, base)
    return "".join(char + mark for char in base)


def _greek(code: str) -> str | None:
    case = "CAPITAL" if code[:1].isupper() else "SMALL"
    try:
        return unicodedata.lookup(f"GREEK {case} LETTER {code.upper()}")
    except KeyError:
        return None


def _code_to_text(match: re.Match[str]) -> str:
    text = _letter(match.group(1))
    return match.group(0) if text is None else text


def _lines(paragraph: str) -> list[str]:
    """A paragraph's wrapped lines joined into lines of text (a new one per numbered sense)."""
    out: list[str] = []
    for line in paragraph.splitlines():
        words = " ".join(line.split())
        if not words:
            continue
        if out and not _SENSE.match(words):
            out[-1] += " " + words
        else:
            out.append(words)
    return out


def clean_entry(raw: bytes) -> str:
    """One dictionary entry as prose: markup dropped, lines joined, ending in a blank line."""
    text = _PRONUNCIATION.sub("", _decode(raw))
    text = _SOURCE_TAG.sub("", text)
    text = _CODE.sub(_code_to_text, text).replace("{", "").replace("}", "")
    lines = [line for paragraph in _BLANK_LINE.split(text) for line in _lines(paragraph)]
    return unicodedata.normalize("NFC", "\n".join(lines) + "\n\n") if lines else ""


def gcide_documents(dict_dz: bytes, index: bytes, origin: str) -> list[str]:
    """Every entry of a dictd dictionary as one cleaned document, in dictionary order."""
    try:
        text = gzip.decompress(dict_dz)
    except (OSError, EOFError, zlib.error) as exc:
        raise QkvlabError(f"{origin}: the .dict.dz is not gzip data ({exc}): "
                          "give the pinned package") from exc
    docs = [clean_entry(text[o : o + n]) for o, n in entry_spans(index, len(text), origin)]
    return [doc for doc in docs if doc]
