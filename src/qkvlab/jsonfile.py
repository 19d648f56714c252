"""The one reader of the JSON files qkvlab takes from disk (a tokenizer's meta.json, a
transformers config.json, a safetensors index, ...).

A file there is data, not something qkvlab wrote a moment ago: it may be well-formed JSON of the
wrong shape (a list, a number where a count goes, arrays nested 100,000 deep). The reader turns
each of these into one QkvlabError line naming the file, the field and the fix, before any caller
indexes into the value, so call sites need no try/except of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError

# Far deeper than any config or meta file qkvlab reads (they nest 3 or 4 levels), far shallower
# than Python's recursion limit, which code walking the value would otherwise hit.
MAX_DEPTH = 32


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# field kind -> (test, words for the message). A kind ending in "?" also accepts null.
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "count": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "index": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "strings": (lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                "a list of strings"),
}


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool) or value is None:
        return "a literal"
    return "a number"


def shown(value: Any, limit: int = 40) -> str:
    """`value` for a one-line message: its repr, cut to `limit` characters (a long integer in
    scientific notation, as float() cannot hold every JSON integer)."""
    if _is_int(value) and len(str(abs(value))) > 12:
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:3]}e{len(digits) - 1}"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def depth_of(value: Any) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # deeper than that is refused anyway: stop counting
            stack.extend((child, level + 1) for child in children)
    return deepest


def check_fields(obj: Mapping[str, Any], fields: Mapping[str, str], where: str, fix: str
                 ) -> None:
    """Refuse (one line) a field of `obj` present with a value not of its kind in `fields`;
    absent fields are left to the caller's defaults."""
    for key, kind in fields.items():
        if key not in obj:
            continue
        value, base = obj[key], kind.rstrip("?")
        if value is None and kind.endswith("?"):
            continue
        test, words = KINDS[base]
        if not test(value):
            raise QkvlabError(f"{where}: {key} must be {words}, got {shown(value)}: {fix}")


def read_json_object(path: Path, fields: Mapping[str, str] | None = None, *, fix: str
                     ) -> dict[str, Any]:
    """The JSON object in `path`, its `fields` checked (see check_fields); anything else (an
    unreadable file, invalid JSON, not an object, nested deeper than MAX_DEPTH, a field of the
    wrong type) is a one-line QkvlabError ending in `fix`."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise QkvlabError(f"{path} nests deeper than {MAX_DEPTH} levels: not a file qkvlab "
                          f"reads; {fix}") from None
    except OSError as exc:
        raise QkvlabError(f"cannot read {path} ({exc.strerror or exc}): {fix}") from None
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise QkvlabError(f"{path} is not valid JSON ({' '.join(str(exc).split())[:120]}): "
                          f"{fix}") from None
    if not isinstance(value, dict):
        raise QkvlabError(f"{path} holds {_json_type(value)} ({shown(value)}), not a JSON "
                          f"object: {fix}")
    if depth_of(value) > MAX_DEPTH:
        raise QkvlabError(f"{path} nests deeper than {MAX_DEPTH} levels: not a file qkvlab "
                          f"reads; {fix}")
    check_fields(value, fields or {}, str(path), fix)
    return value
