"""Retrofitting a trained standard model to W_Q = I: convert as well as theory allows, then heal.

docs/paper.md section 3: a pre-LN GPT with full skips has no exact conversion (the norm blocks the
basis change a generic W_Q needs, and full skips would need one basis for every layer). So the
retrofit starts from the closest model we can justify (`qkvlab.retrofit.init`) and heals it with
a short fine-tune or distillation against the original's logits (`qkvlab.retrofit.heal`).
"""

from qkvlab.retrofit.heal import HealConfig, heal
from qkvlab.retrofit.init import INITS, attention_moments, build_student

__all__ = ["INITS", "HealConfig", "attention_moments", "build_student", "heal"]
