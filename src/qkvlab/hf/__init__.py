"""Hugging Face interop: export to / import from the GPT-2 and Llama architectures of
`transformers`, and lm-eval-harness on an exported model.

The weight mappings live in `qkvlab.hf.gpt2` and `qkvlab.hf.llama` and need neither
`transformers` nor the hub: a model directory is config.json + model.safetensors, written and
read with json and safetensors.
`transformers` is only imported to verify an export (logits compared) when it is installed,
and by `identity_query`, which makes a transformers Llama or GPT-2 model W_Q = I in place.
"""

from qkvlab.hf.gpt2 import export_problem, from_gpt2, to_gpt2
from qkvlab.hf.identity_query import IdentityQueryReport, identity_query

__all__ = ["IdentityQueryReport", "export_problem", "from_gpt2", "identity_query", "to_gpt2"]
