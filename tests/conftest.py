"""Fixtures shared by the test modules (the helpers they import are in helpers.py)."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from qkvlab.data.prepare import prepare

# a tiny pseudo-verse vocabulary: a char dataset of ~8 KB, prepared in well under a second
WORDS = ("the king is dead long live the queen my lord what say you to this fair maid "
         "hark who goes there and wherefore art thou so sad good night sweet prince").split()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and CPUs shared with other jobs punish more."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state, whichever tests ran before it: inputs
    drawn from the global generators (torch.randn, ...) are the same on every run."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A tiny char-level dataset prepared from a local text file, fresh for each module."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
             for _ in range(200)]
    text_file = root / "verse.txt"
    text_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = root / "verse-char"
    prepare(str(text_file), "char", out, val_fraction=0.1)
    return out
