"""The model family: config, transformer, parameter accounting, generation."""

from qkvlab.model.config import PROJECTIONS, ModelConfig
from qkvlab.model.gpt import GPT, KVCache

__all__ = ["GPT", "KVCache", "ModelConfig", "PROJECTIONS"]
