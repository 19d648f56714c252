"""What a reader meets first stays short and its links lead somewhere: README's findings are at
most 12 lines of at most 100 characters, the results index at most 200 lines, and every
relative link of both names a file in the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def findings() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## What qkvlab found", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.strip()]


def test_readme_findings_are_twelve_short_lines():
    lines = findings()
    assert 0 < len(lines) <= 12, len(lines)
    assert all(len(line) <= 100 for line in lines), [ln for ln in lines if len(ln) > 100]


def test_the_results_index_stays_an_index():
    assert len((REPO / "docs/results/README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_every_relative_link_of_readme_and_the_index_exists():
    for page in (REPO / "README.md", REPO / "docs/results/README.md"):
        for a, b in LINK.findall(page.read_text(encoding="utf-8")):
            target = (a or b).split("#")[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"
