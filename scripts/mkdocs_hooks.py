"""mkdocs hook (mkdocs.yml ``hooks:``): links from a docs page to a repository file outside
``docs/`` (``../benchmarks/results/results.md``: right on GitHub, absent from the site) become
the link text plus the file's repository path in the site, so ``mkdocs build --strict`` still
fails on a link to a file that exists nowhere."""

from __future__ import annotations

import os
import re
from typing import Any

_LINK = re.compile(r"(!?)\[([^\]]*)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = os.path.abspath(config["docs_dir"])
    repo = os.path.dirname(docs)
    here = os.path.dirname(os.path.join(docs, page.file.src_path))

    def outside(match: re.Match[str]) -> str:
        image, text, target = match.group(1), match.group(2), match.group(3)
        path = os.path.normpath(os.path.join(here, target))
        if path.startswith(docs + os.sep) or not path.startswith(repo + os.sep) \
                or not os.path.exists(path):
            return match.group(0)  # inside docs/, or missing: mkdocs judges it
        shown = os.path.relpath(path, repo)
        label = text or shown
        return f"{label} (`{shown}` in the repository)" if not image \
            else f"*{label}: `{shown}` in the repository*"

    return _LINK.sub(outside, markdown)
