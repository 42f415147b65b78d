"""The fenced code blocks of the docs pages, and which of them the docs test runs.

Pure parsing, no I/O beyond reading the page: see tests/docs/README.md for the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: fence languages the test runs
RUN_LANGUAGES = ("python", "bash")
#: the visible line that exempts the block right below it (one blank line allowed between)
MARK = re.compile(r"^\s*\*Not run by the docs test: (?P<reason>.+?)\.?\*\s*$")
_OPEN = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_TITLE = re.compile(r"""\btitle=["']?(?P<title>[^"'\s]+)["']?""")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and its exemption, if any."""

    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str  # "" for a bare fence
    title: str | None  # title="NAME.py": written to NAME.py, not executed
    text: str
    mark: str | None  # the reason given by a preceding *Not run by the docs test: ...* line

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """True when the test executes (or writes, for a titled block) this block."""
        return self.language in RUN_LANGUAGES and self.mark is None


def pages(root: Path) -> list[Path]:
    """README.md and every docs/**/*.md, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks(path: Path, root: Path) -> list[Block]:
    """Every fenced block of the page at ``path``, in order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    page = path.relative_to(root).as_posix()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _OPEN.match(lines[i])
        if match is None:
            i += 1
            continue
        end = _closing(lines, i + 1, match["fence"])
        found.append(_block(page, lines, i, end, match))
        i = end + 1
    return found


def _closing(lines: list[str], start: int, fence: str) -> int:
    closer = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    for j in range(start, len(lines)):
        if closer.match(lines[j]):
            return j
    return len(lines)  # unclosed: runs to the end of the page, as Markdown renders it


def _block(page: str, lines: list[str], start: int, end: int, match: re.Match[str]) -> Block:
    info = match["info"].strip()
    language = info.split()[0].lower() if info else ""
    title = _TITLE.search(info)
    indent = len(match["indent"])
    body = [line[indent:] if not line[:indent].strip() else line.lstrip()
            for line in lines[start + 1 : end]]
    return Block(page=page, line=start + 1, language=language,
                 title=title["title"] if title else None,
                 text="\n".join(body) + "\n", mark=_mark(lines, start))


def _mark(lines: list[str], start: int) -> str | None:
    before = start - 1
    if before >= 0 and not lines[before].strip():
        before -= 1
    if before < 0:
        return None
    found = MARK.match(lines[before])
    return found["reason"] if found else None


def bucket_names(page_blocks: list[Block]) -> list[str]:
    """The S3 buckets the page's run blocks name (``s3://NAME/...``), to create before the run;
    a name starting ``no-such-`` is left out (a page showing what a missing bucket does)."""
    names: set[str] = set()
    for block in page_blocks:
        if block.runs:
            names.update(re.findall(r"s3://([a-z0-9][a-z0-9.-]{2,62})", block.text))
    return sorted(n for n in names if not n.startswith("no-such-"))
