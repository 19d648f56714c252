"""Does a setting tuned at one shape carry to others? The transfer table of a sweep that tunes lr
and alpha at one shape (the base: each family's shape with the most cells) and runs a few cells
around that optimum at other widths and depths.

At each other shape a family's row holds its best cell, the cell at the base optimum's lr and
alpha (the "centre": what a user who tuned once would run), the centre's loss over the best, and
how many factors of 2 the best lies from the base optimum on each axis. Transfer holds at a shape
when the centre is within TOLERANCE_PCT of the shape's best and the best lies within one factor
of 2 of the base optimum on both axes with a scanned cell beyond it on each axis it moved along
(an optimum at the edge of what ran may lie further out: "edge"). Under μP this is the test of
the parametrization; under the standard one the table shows how far the optimum moves.
The loss of a cell is its mean final validation loss over its seeds (the report's loss measure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qkvlab.experiments.results import GroupResult, Report

# the base setting's loss may exceed a shape's best by this much and still count as transferred
TOLERANCE_PCT = 0.3
# cells a family's tuned shape needs (a 2 x 2 grid at least) before its best is a tuned setting
MIN_TUNED_CELLS = 4


@dataclass(frozen=True)
class Cell:
    group: str
    lr: float
    alpha: float
    loss: float  # mean final validation loss over its seeds
    seeds: int
    weight_decay: float = 0.0  # part of the setting carried: a centre matches it too


@dataclass(frozen=True)
class TransferRow:
    family: str
    width: int
    depth: int
    base: bool  # the shape the family was tuned at
    cells: tuple[Cell, ...]
    optimum: Cell  # the base shape's best cell: the setting carried
    parametrization: str

    @property
    def best(self) -> Cell:
        return min(self.cells, key=lambda c: c.loss)

    @property
    def centre(self) -> Cell | None:
        """The cell at the base optimum's lr and alpha (None: not run at this shape)."""
        o = self.optimum
        return next((c for c in self.cells if same_setting(c.lr, o.lr)
                     and same_setting(c.alpha, o.alpha)
                     and c.weight_decay == o.weight_decay), None)

    @property
    def centre_gap_pct(self) -> float | None:
        c = self.centre
        return None if c is None else 100.0 * (c.loss / self.best.loss - 1.0)

    @property
    def lr_steps(self) -> float:
        """Factors of 2 from the base optimum's lr to this shape's best (+: larger)."""
        return math.log2(self.best.lr / self.optimum.lr)

    @property
    def alpha_steps(self) -> float:
        return math.log2(self.best.alpha / self.optimum.alpha)

    @property
    def bracketed(self) -> bool:
        """A cell ran beyond the best on every axis the best moved along (and on both sides
        when it did not move): the optimum lies inside what ran."""
        b = self.best
        for value, key in ((b.lr, "lr"), (b.alpha, "alpha")):
            seen = [getattr(c, key) for c in self.cells]
            if not (any(v < value * 0.99 for v in seen) and any(v > value * 1.01 for v in seen)):
                return False
        return True

    @property
    def verdict(self) -> str:
        """"holds", "fails" (the centre is more than TOLERANCE_PCT behind, or the best is more
        than one step away), "edge" (within tolerance, but the best sits at the edge of what
        ran), "no centre" (the base setting did not run here) or "one cell" (only it ran)."""
        gap = self.centre_gap_pct
        if gap is None:
            return "no centre"
        if len(self.cells) < 2:
            return "one cell"  # nothing to compare the centre with
        far = abs(self.lr_steps) > 1.01 or abs(self.alpha_steps) > 1.01
        if gap > TOLERANCE_PCT or far:
            return "fails"
        return "holds" if self.bracketed or self.best is self.centre else "edge"

    def as_dict(self) -> dict[str, Any]:
        centre = self.centre
        return {"family": self.family, "width": self.width, "depth": self.depth,
                "base": self.base, "parametrization": self.parametrization,
                "cells": len(self.cells), "best": _cell_json(self.best),
                "centre": _cell_json(centre) if centre else None,
                "centre_gap_pct": self.centre_gap_pct, "lr_steps": self.lr_steps,
                "alpha_steps": self.alpha_steps, "bracketed": self.bracketed,
                "verdict": self.verdict, "tolerance_pct": TOLERANCE_PCT}


def same_setting(a: float, b: float) -> bool:
    return abs(a / b - 1.0) < 1e-6


def _cell_json(c: Cell) -> dict[str, Any]:
    return {"group": c.group, "lr": c.lr, "alpha": c.alpha, "weight_decay": c.weight_decay,
            "loss": c.loss, "seeds": c.seeds}


def _shape(g: GroupResult) -> tuple[int, int]:
    m = g.group.config.model
    return m.n_embd, m.n_layer


def transfer_rows(rep: Report) -> list[TransferRow]:
    """Each family's row per shape, its base shape first, when it ran at two or more shapes and
    its tuned shape holds MIN_TUNED_CELLS cells or more (empty otherwise)."""
    by_family: dict[str, dict[tuple[int, int], list[Cell]]] = {}
    param: dict[str, str] = {}
    for g in rep.groups:
        if not g.loss.n:
            continue
        cfg = g.group.config
        cell = Cell(g.group.name, cfg.optim.lr, cfg.model.alpha, g.loss.mean, g.loss.n,
                    cfg.optim.weight_decay)
        by_family.setdefault(g.group.family, {}).setdefault(_shape(g), []).append(cell)
        param[g.group.family] = cfg.model.parametrization
    rows: list[TransferRow] = []
    for family, shapes in by_family.items():
        # the tuned shape: the most cells, the smaller shape on a tie
        base = max(shapes, key=lambda s: (len(shapes[s]), -s[0] * s[1]))
        if len(shapes) < 2 or len(shapes[base]) < MIN_TUNED_CELLS:
            continue
        optimum = min(shapes[base], key=lambda c: c.loss)
        for shape in [base, *sorted(s for s in shapes if s != base)]:
            rows.append(TransferRow(family, *shape, shape == base, tuple(shapes[shape]),
                                    optimum, param[family]))
    return rows


def transfer_section(rows: list[TransferRow], figure: str | None) -> list[str]:
    """The report's Markdown section: one line per family and shape."""
    if not rows:
        return []
    L = ["", "## Transfer from the tuned shape", "",
         f"Each family's best cell at its tuned shape (the one with the most cells) carried to "
         f"the others: the centre is that lr and alpha at the shape; transfer holds where the "
         f"centre is within {TOLERANCE_PCT}% of the shape's best and the best lies within one "
         "factor of 2 of the carried setting, inside what ran (\"edge\": the best sits at the "
         "edge of what ran there). Losses are means over each cell's seeds.", ""]
    if figure:
        L += [f"![loss against lr and alpha at each shape, relative to its best]({figure})", ""]
    L += ["| family | shape | cells | best: lr, alpha, loss | steps from the carried "
          "(lr, alpha) | centre's loss | centre over best | transfer |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, c, gap = r.best, r.centre, r.centre_gap_pct
        shape = f"d {r.width} x {r.depth}" + (" (tuned)" if r.base else "")
        L.append(f"| {r.family} | {shape} | {len(r.cells)} | {b.lr:g}, {b.alpha:g}, "
                 f"{b.loss:.4f} | {r.lr_steps:+.1f}, {r.alpha_steps:+.1f} | "
                 f"{'-' if c is None else f'{c.loss:.4f}'} | "
                 f"{'-' if gap is None else f'{gap:+.2f}%'} | "
                 f"{'(the tuned shape)' if r.base else r.verdict} |")
    return L
