"""The run folder: its config, layout, checkpoints, metrics, lock; helpers every tool shares.

This package sits below `qkvlab.train` and the tools (theory, hf, retrofit, experiments, bench):
they all read and write run folders through it, and it never imports them. Import from the
submodules (`qkvlab.run.layout`, `.checkpoint`, `.store`, `.load`, ...).
"""
