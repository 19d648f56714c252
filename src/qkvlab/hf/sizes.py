"""The size fields of an imported config.json, held against the tensors present before anything
is built from them.

config.json is data from disk: n_layer = 10**30 would make the import loop that many times, and
intermediate_size = 10**9 would allocate that many rows, long before any shape comparison
could refuse it. No real model has more layers than it stores, nor a width larger than every
dimension of its weights (head counts included: each head owns at least one row), so both are
checked first, from the tensors' shapes alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qkvlab.errors import QkvlabError
from qkvlab.jsonfile import shown

# "h.3." (GPT-2) or "layers.3." (Llama), after any "transformer." / "model." prefix
LAYER_KEY = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")


def _int_field(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def layers_present(tensors: Mapping[str, torch.Tensor]) -> int:
    """How many distinct layer indices the tensor names hold."""
    return len({m.group(1) for m in map(LAYER_KEY.search, tensors) if m})


def largest_dim(tensors: Mapping[str, torch.Tensor]) -> int:
    """The largest dimension of any tensor present (0 when there are none)."""
    return max((max(t.shape, default=1) for t in tensors.values()), default=0)


def check_sizes(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
                layers: Iterable[str], widths: Iterable[str]) -> None:
    """Refuse (one line) a layer-count field above the layers the weights hold, or a width
    field above their largest dimension. Fields that are absent or not integers are left to
    the type checks."""
    held = layers_present(tensors)
    for key in layers:
        value = _int_field(config, key)
        if value is not None and value > held:
            raise QkvlabError(f"config.json: {key}={shown(value, 24)} but the weights hold "
                              f"{held} layer(s) and lack the others: the files do not match "
                              "config.json")
    widest = largest_dim(tensors)
    for key in widths:
        value = _int_field(config, key)
        if value is not None and value > widest:
            what = "mismatched vocabularies: " if key == "vocab_size" else ""
            raise QkvlabError(f"{what}config.json: {key}={shown(value, 24)} is larger than "
                              f"every dimension of the weights (the largest is {widest}): the "
                              "files do not match config.json")
