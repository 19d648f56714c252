"""Tokenizers: gpt2 built offline, char, bytes, trained BPE; round trips and reloading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkvlab.data.tokenizer import (
    BPETokenizer,
    BytesTokenizer,
    CharTokenizer,
    build_tokenizer,
    load_tokenizer,
    parse_spec,
)
from qkvlab.errors import QkvlabError

SAMPLE = "Hello, world! Ünïcödé 🙂 tabs\tand\nnewlines, 'quotes' and   spaces.\n" * 20


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("gpt2")


@pytest.fixture(scope="module")
def bpe300():
    return build_tokenizer("bpe:300", [SAMPLE, "the quick brown fox jumps over the lazy dog"])


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("hello world") == [31373, 995]
    assert gpt2.vocab_size == 50257
    assert gpt2.eot_token == 50256
    assert gpt2.decode([31373, 995]) == "hello world"


def test_gpt2_round_trip_and_special_text_is_ordinary(gpt2):
    text = SAMPLE + "<|endoftext|>"
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    assert 50256 not in ids  # a literal special-token string in a document stays text
    assert gpt2.encode_batch(["hello world", "hi"]) == [[31373, 995], gpt2.encode("hi")]
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_gpt2_bad_id(gpt2):
    with pytest.raises(QkvlabError, match="outside"):
        gpt2.decode([50257])


def test_bytes_tokenizer():
    tok = BytesTokenizer()
    assert tok.vocab_size == 256 and tok.eot_token is None
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode([0xC3]) == "\ufffd"  # a lone lead byte decodes with errors="replace"
    with pytest.raises(QkvlabError):
        tok.decode([256])


def test_char_tokenizer_and_reload(tmp_path):
    tok = build_tokenizer("char", ["hello", "world"])
    assert tok.vocab_size == len(set("helloworld"))
    assert tok.chars == sorted(set("helloworld"))
    assert tok.decode(tok.encode("hello world".replace(" ", ""))) == "helloworld"
    with pytest.raises(QkvlabError, match="not in this char vocabulary"):
        tok.encode("z")
    with pytest.raises(QkvlabError):
        tok.decode([-1])
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path, {"tokenizer": "char", "vocab_size": tok.vocab_size})
    assert again.chars == tok.chars


def test_bpe_round_trip_and_reload(tmp_path, bpe300):
    assert bpe300.name == "bpe:300"
    assert 257 <= bpe300.vocab_size <= 300
    assert bpe300.eot_token is not None
    ids = bpe300.encode(SAMPLE)
    assert len(ids) < len(SAMPLE.encode())  # merges were learnt
    assert bpe300.decode(ids) == SAMPLE
    # A literal "<|endoftext|>" in text is not the eot token.
    assert bpe300.eot_token not in bpe300.encode("a<|endoftext|>b")
    assert bpe300.decode(bpe300.encode("a<|endoftext|>b")) == "a<|endoftext|>b"
    bpe300.save(tmp_path)
    again = load_tokenizer(tmp_path, {"tokenizer": "bpe:300", "vocab_size": bpe300.vocab_size})
    assert isinstance(again, BPETokenizer)
    assert again.encode(SAMPLE) == ids


def test_bpe_training_is_deterministic():
    a = build_tokenizer("bpe:280", [SAMPLE])
    b = build_tokenizer("bpe:280", [SAMPLE])
    assert a.encode(SAMPLE) == b.encode(SAMPLE)


def test_load_tokenizer_vocab_mismatch(tmp_path):
    CharTokenizer("abc").save(tmp_path)
    with pytest.raises(QkvlabError, match="vocab_size"):
        load_tokenizer(tmp_path, {"tokenizer": "char", "vocab_size": 4})


def test_load_tokenizer_missing_files(tmp_path):
    with pytest.raises(QkvlabError, match="re-run qkvlab prepare"):
        load_tokenizer(tmp_path, {"tokenizer": "bpe:300"})
    with pytest.raises(QkvlabError, match="re-run qkvlab prepare"):
        load_tokenizer(tmp_path, {"tokenizer": "char"})
    with pytest.raises(QkvlabError, match="no prepared data"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_from_meta_file(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
    assert isinstance(load_tokenizer(tmp_path), BytesTokenizer)


@pytest.mark.parametrize("spec", ["wordpiece", "bpe", "bpe:", "bpe:12", "bpe:x", "gpt-2", ""])
def test_unknown_spec(spec):
    with pytest.raises(QkvlabError, match="char, bytes, gpt2, bpe:N"):
        parse_spec(spec)


def test_fitted_tokenizers_need_texts():
    with pytest.raises(ValueError):
        build_tokenizer("char")


@given(st.text(max_size=200))
def test_bytes_round_trip_property(text):
    tok = BytesTokenizer()
    assert tok.decode(tok.encode(text)) == text


@given(st.text(min_size=1, max_size=200))
def test_char_round_trip_property(text):
    tok = CharTokenizer.from_texts([text])
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=100))
def test_bpe_round_trip_property(bpe300, text):
    # Byte-level BPE covers every byte, so any text round-trips, seen in training or not.
    assert bpe300.decode(bpe300.encode(text)) == text
