"""The RNG states a training step may touch, as JSON-able data, and their shape check."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from qkvlab.errors import QkvlabError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may touch, as JSON-able data."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` recorded (CUDA states only when the device count matches).

    A malformed state (from a hand-edited or foreign state.json) raises QkvlabError, not
    whatever the setters happen to raise.
    """
    try:
        torch.set_rng_state(_unb64(state["torch"]))
        if "python" in state:
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in state:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                 cached))
        cuda = state.get("cuda")
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError, AttributeError) as exc:
        raise QkvlabError(f"the RNG state of the checkpoint is malformed ({type(exc).__name__}): "
                          "the checkpoint was not written by qkvlab train") from None


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def rng_ok(rng: Any) -> bool:
    """Whether `rng` has the shape `rng_state` writes (checked before any setter sees it)."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), str):
        return False
    try:
        if len(base64.b64decode(rng["torch"], validate=True)) != torch.get_rng_state().numel():
            return False
    except ValueError:
        return False
    py, npy = rng.get("python"), rng.get("numpy")
    if py is not None and not (isinstance(py, list) and len(py) == 3 and is_int(py[0])
                               and isinstance(py[1], list) and len(py[1]) == 625
                               and all(is_int(v) and 0 <= v < 1 << 32 for v in py[1])
                               and (py[2] is None or is_number(py[2]))):
        return False
    if npy is not None and not (isinstance(npy, list) and len(npy) == 5 and npy[0] == "MT19937"
                                and isinstance(npy[1], list) and len(npy[1]) == 624
                                and all(is_int(v) and 0 <= v < 1 << 32 for v in npy[1])
                                and all(is_int(v) for v in npy[2:4]) and is_number(npy[4])):
        return False
    cuda = rng.get("cuda")
    return cuda is None or (isinstance(cuda, list) and all(isinstance(c, str) for c in cuda))
