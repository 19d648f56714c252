"""Training: AdamW + schedule, the loop, distributed training (the config: qkvlab.run.config).

`from qkvlab.train import train` is the entry point (`train(cfg, resume=...)`); the rest is
in the submodules (`qkvlab.run.config`, `.trainer`, `.session`, `.steps`, ...). This package
module stays light so `qkvlab --help` does not import torch: `train` is loaded on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "train":
        # deferred: the trainer imports torch, which `qkvlab --help` must not pay for
        from qkvlab.train.trainer import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
