"""Training: configs and presets, AdamW + schedule, checkpoints, the loop, CLI commands.

Import from the submodules (`qkvlab.train.config`, `.trainer`, `.checkpoint`, ...); this
package module stays light so `qkvlab --help` does not import torch.
"""
