"""Every page's code runs: the fenced ``python`` / ``bash`` blocks of README.md and
docs/**/*.md, one test per page, against the suite's SeaweedFS (rules: tests/docs/README.md).

Run one page: ``pytest -n 0 tests/docs/test_snippets.py -k getting-started``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from _snippet_blocks import MARK, RUN_LANGUAGES, Block, blocks, bucket_names, pages
from _snippet_run import PageRun, block_env, launcher_dir

REPO = Path(__file__).resolve().parents[2]
PAGES = pages(REPO)

#: the standard variables a user's S3 client reads; nothing else tells a block where the store is
_AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                  "AWS_DEFAULT_REGION")


def _params() -> list[Any]:
    return [pytest.param(page, id=page.relative_to(REPO).as_posix().removesuffix(".md")
                         .replace("/", "-")) for page in PAGES]


@pytest.fixture(scope="module")
def bindir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launcher_dir(tmp_path_factory.mktemp("docs-bin"))


@pytest.fixture
def page_store(seaweedfs: Any) -> Iterator[tuple[Any, dict[str, str]]]:
    server = seaweedfs.server
    env = server.env()
    yield server, {name: env[name] for name in _AWS_VARIABLES}


def _fresh_buckets(server: Any, names: list[str]) -> None:
    """Creates the buckets a page names, empty: every page starts from nothing stored."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options())
    for name in names:
        server.create_bucket(name)
        leftovers = fs.find(name)
        if leftovers:
            fs.rm(leftovers)


def _check_fences(page_blocks: list[Block]) -> None:
    bare = [b.where for b in page_blocks if not b.language]
    assert not bare, (f"fence(s) with no language at {', '.join(bare)}: name one: "
                      f"{' or '.join(RUN_LANGUAGES)} for code the docs test runs, text or "
                      "console for output and anything not to run")
    stray = [b.where for b in page_blocks if b.mark is not None
             and b.language not in RUN_LANGUAGES]
    assert not stray, (f"'{MARK.pattern}' mark above a block the test would not run anyway "
                       f"at {', '.join(stray)}: remove the mark")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", _params())
def test_page_blocks_run(page: Path, page_store: tuple[Any, dict[str, str]], bindir: Path,
                         tmp_path: Path) -> None:
    """The page's python/bash blocks run in order in one scratch directory; the others carry
    the visible *Not run by the docs test: ...* mark (checked by the parser: a block is either
    run or marked, never skipped silently)."""
    page_blocks = blocks(page, REPO)
    _check_fences(page_blocks)
    runnable = [b for b in page_blocks if b.runs]
    if not runnable:
        return
    server, aws = page_store
    _fresh_buckets(server, bucket_names(page_blocks))
    scratch = tmp_path / "page"
    scratch.mkdir()
    run = PageRun(REPO, scratch, block_env(REPO, bindir, aws))
    try:
        for block in runnable:
            run.run(block)
    finally:
        run.close()
