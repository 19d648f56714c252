"""Numerical checks of docs/paper.md sections 1-4: exact conversions and measured limits."""

from qkvlab.theory.convert import (
    TARGETS,
    ConversionReport,
    Hypothesis,
    approximate_convert,
    convert,
)

__all__ = ["TARGETS", "ConversionReport", "Hypothesis", "approximate_convert", "convert"]
