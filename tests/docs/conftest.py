"""The docs test's summary: how many blocks each page has, how many run, how many are marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _snippet_blocks import RUN_LANGUAGES, blocks, pages

_REPO = Path(__file__).resolve().parents[2]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reports = terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
    ran = [r for r in reports if "test_page_blocks_run" in getattr(r, "nodeid", "")]
    if not ran:
        return
    rows = []
    totals = [0, 0, 0]
    for page in pages(_REPO):
        code = [b for b in blocks(page, _REPO) if b.language in RUN_LANGUAGES]
        counts = [len(code), sum(b.runs for b in code), sum(b.mark is not None for b in code)]
        totals = [t + c for t, c in zip(totals, counts)]
        if counts[0]:
            rows.append(f"  {page.relative_to(_REPO).as_posix():45} {counts[0]:5} {counts[1]:5} "
                        f"{counts[2]:7}")
    terminalreporter.write_sep("-", "docs snippets (python/bash blocks)")
    terminalreporter.write_line(f"  {'page':45} {'found':>5} {'run':>5} {'marked':>7}")
    for row in rows:
        terminalreporter.write_line(row)
    terminalreporter.write_line(f"  {'total':45} {totals[0]:5} {totals[1]:5} {totals[2]:7}")
