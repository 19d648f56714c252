"""Downstream evaluation (HellaSwag, PIQA, WinoGrande, ARC, LAMBADA) with qkvlab's own scorer.

tasks: the task definitions and lm-eval's prompts; data: the pinned task data; scorer:
log-likelihoods under a qkvlab GPT; metrics: acc, acc_norm, perplexity; report: table and
JSON; evaluate: the whole evaluation of one checkpoint. See docs/eval.md.
"""
