"""The integrations index's "lines to switch" column agrees with the pages (issue 26).

A count ``N (`FILE`)`` in the column is the number of lines of the linked page's
``python title="FILE"`` block that end in ``# switch`` (the rule is stated in
docs/integrations/README.md). The programs themselves run in tests/docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations"
_COUNT = re.compile(r"(\d+) \(`([\w.-]+\.py)`\)")
_LINK = re.compile(r"\[[^\]]+\]\(([\w.-]+\.md)\)")
_TITLED = re.compile(r'^```python title="(?P<title>[^"]+)"\n(?P<body>.*?)^```$',
                     re.MULTILINE | re.DOTALL)


def _rows() -> list[tuple[str, list[tuple[int, str]]]]:
    """(page, [(count, file), ...]) for every row of the index that names a page."""
    rows = []
    for line in (DOCS / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = _LINK.search(cells[-1]) if len(cells) == 4 else None
        if link is not None:
            rows.append((link[1], [(int(n), f) for n, f in _COUNT.findall(cells[2])]))
    return rows


def _switch_lines(page: str, title: str) -> int:
    text = (DOCS / page).read_text(encoding="utf-8")
    bodies = [m["body"] for m in _TITLED.finditer(text) if m["title"] == title]
    assert len(bodies) == 1, f"{page} has {len(bodies)} blocks titled {title!r}"
    return sum(1 for line in bodies[0].splitlines() if line.rstrip().endswith("# switch"))


def test_the_index_counts_every_framework_page_of_this_wing() -> None:
    counted = {page for page, counts in _rows() if counts}
    assert {"torchtitan.md", "lightning.md", "huggingface.md", "torch_checkpointing.md"} <= counted


@pytest.mark.parametrize(
    ("page", "count", "title"),
    [(page, n, f) for page, counts in _rows() for n, f in counts],
    ids=lambda v: str(v))
def test_lines_to_switch_match_the_marked_lines(page: str, count: int, title: str) -> None:
    assert _switch_lines(page, title) == count
