"""Data layer: corpora, tokenizers, preparing token files, deterministic batching."""

from qkvlab.data.cache import cache_dir, fetch_from_wheel, fetch_url
from qkvlab.data.corpus import read_source, shakespeare_path
from qkvlab.data.loader import TokenData
from qkvlab.data.prepare import default_data_dir, prepare, token_dtype
from qkvlab.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer

__all__ = [
    "TokenData",
    "Tokenizer",
    "build_tokenizer",
    "cache_dir",
    "default_data_dir",
    "fetch_from_wheel",
    "fetch_url",
    "load_tokenizer",
    "prepare",
    "read_source",
    "shakespeare_path",
    "token_dtype",
]
