"""The API reference (docs/api.md, built by mkdocs + mkdocstrings from the docstrings)
documents every keyword of what it lists: each parameter of each class/function the page
renders has an entry in its docstring's ``Args:`` block (issue 26: "a user looking up
VolumeWriter's options finds every keyword there"). The strict build itself is a CI step
(``.ci/run``: ``mkdocs build --strict``)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _rendered() -> list[str]:
    """``module:Name`` of each object docs/api.md renders (``::: a.b.C`` lines, and the
    ``members:`` lists under a ``::: module`` line; a ``::: module`` without one renders the
    whole module: its ``__all__``)."""
    out: list[str] = []
    module = None
    whole: list[str] = []  # a module's __all__, until a members: list says otherwise

    def flush() -> None:
        out.extend(whole)
        whole.clear()

    for line in (DOCS / "api.md").read_text().splitlines():
        if line.startswith("::: "):
            flush()
            path = line[4:].strip()
            head, _, name = path.rpartition(".")
            try:
                mod = importlib.import_module(path)
                module = path  # a whole module, unless a members: list follows
                whole.extend(f"{path}:{n}" for n in getattr(mod, "__all__", ()))
            except ImportError:
                out.append(f"{head}:{name}")
                module = None
        elif module and re.match(r"\s+members:", line):
            whole.clear()
        elif module and (m := re.match(r"\s+- (\w+)$", line)):
            out.append(f"{module}:{m.group(1)}")
    flush()
    return out


def _documented(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    init = getattr(obj, "__init__", None)
    if inspect.isclass(obj) and init is not None and init.__doc__:
        doc += "\n" + (inspect.getdoc(init) or "")
    return doc


@pytest.mark.parametrize("target", [t for t in _rendered() if "errors:" not in t])
def test_every_keyword_is_in_the_args_block(target: str) -> None:
    module, name = target.split(":")
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj) and not re.search(r"(Options|Policy|Writer|Reader|Checkpointer)$",
                                              name):
        return  # a result (a report, stats, a plan) or an error: what users get, not pass
    doc = _documented(obj)
    entry = r"^\s*(\*\*|\*)?{}( \([^)]*\))?:"
    missing = [p for p in inspect.signature(obj).parameters
               if p != "self" and not re.search(entry.format(p), doc, re.MULTILINE)]
    assert not missing, f"{target}: not in its docstring's Args block: {missing}"


def test_the_page_lists_the_public_surface() -> None:
    rendered = {t.split(":")[1] for t in _rendered()}
    import dcp_volumes

    # errors: the module, rendered whole (its classes are re-exported at the top level)
    assert set(dcp_volumes.__all__) - {"__version__", "errors"} <= rendered
    assert {"VolumeWriter", "VolumeReader", "list_checkpoints", "gc", "plan_intervals"} <= rendered
