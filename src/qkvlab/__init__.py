"""qkvlab: attention without a redundant W_Q (arXiv:2510.23912), from theory to training."""

__version__ = "0.1.0"
