"""The transfer figure (qkvlab.experiments.transfer): per family, the loss against lr at the
carried alpha and against alpha at the carried lr, one line per shape, each shape's loss over
its own best, so that transfer reads as every line's minimum at the same x."""

from __future__ import annotations

from pathlib import Path

from qkvlab.experiments.plot_layout import (
    facets,
    legend_beside,
    log2_axis,
    pyplot,
    save,
    suptitle,
    variant_looks,
)
from qkvlab.experiments.transfer import TOLERANCE_PCT, TransferRow, same_setting

CLIP_PCT = 10.0  # losses further above a shape's best are drawn at the top edge, as triangles


def _label(r: TransferRow) -> str:
    return f"d {r.width} x {r.depth}" + (" (tuned)" if r.base else "")


def plot_transfer(rows: list[TransferRow], title: str, path: Path) -> bool:
    """Draw the figure; False (nothing drawn) when no shape besides the tuned one has a cell
    on either line through the carried setting."""
    families = list(dict.fromkeys(r.family for r in rows))
    if not any(not r.base and r.centre for r in rows):
        return False
    plt = pyplot()
    fig, axes = facets(plt, 2 * len(families), ncols=2)
    looks = variant_looks(list(dict.fromkeys(_label(r) for r in rows)))
    for i, family in enumerate(families):
        mine = [r for r in rows if r.family == family]
        opt = mine[0].optimum
        for ax, key, fixed, other in ((axes[2 * i], "lr", "alpha", opt.alpha),
                                      (axes[2 * i + 1], "alpha", "lr", opt.lr)):
            xs: set[float] = set()
            for r in mine:
                line = sorted((c for c in r.cells if same_setting(getattr(c, fixed), other)
                               and c.weight_decay == opt.weight_decay),
                              key=lambda c: getattr(c, key))
                if len(line) < 2:
                    continue
                x = [getattr(c, key) for c in line]
                y = [100.0 * (c.loss / r.best.loss - 1.0) for c in line]
                xs.update(x)
                look = looks[_label(r)]
                ax.plot(x, [min(v, CLIP_PCT) for v in y], marker="o", ms=4, label=_label(r),
                        **look)
                clipped = [(a, b) for a, b in zip(x, y, strict=True) if b > CLIP_PCT]
                if clipped:
                    ax.plot([a for a, _ in clipped], [CLIP_PCT] * len(clipped), "^", ms=8,
                            color=look["color"])
            ax.axvline(getattr(opt, key), color="gray", lw=0.8, ls=":")
            ax.axhspan(0, TOLERANCE_PCT, color="gray", alpha=0.15, lw=0)
            if xs:
                log2_axis(ax, sorted(xs), key)
            ax.set_ylim(-0.3, CLIP_PCT * 1.08)
            ax.set_ylabel("final loss over the shape's best (%)")
            ax.set_title(f"{family}: {key} at {fixed} {other:g}", fontsize=9)
            legend_beside(ax)
    suptitle(fig, f"{title}\nthe tuned setting (dotted) carried to other shapes; grey band: "
                  f"within {TOLERANCE_PCT}% of the best; triangles: over {CLIP_PCT:g}%")
    save(plt, fig, path)
    return True
