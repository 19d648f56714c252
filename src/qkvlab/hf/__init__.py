"""Hugging Face interop: export to / import from the GPT-2 and Llama architectures of
`transformers`, and lm-eval-harness on an exported model.

The weight mappings live in `qkvlab.hf.gpt2` and `qkvlab.hf.llama` and need neither
`transformers` nor the hub: a model directory is config.json + model.safetensors, written and
read with json and safetensors.
`transformers` is only imported to verify an export (logits compared) when it is installed.
"""

from qkvlab.hf.gpt2 import export_problem, from_gpt2, to_gpt2

__all__ = ["export_problem", "from_gpt2", "to_gpt2"]
