"""The public surface (issue 24, item 5): the error hierarchy is reachable from the top level
without making ``import dcp_volumes`` pay for torch, and every name a subpackage's ``__all__``
lists resolves (the lazy ones included)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import dcp_volumes
from dcp_volumes import errors


def test_every_error_is_reachable_from_the_top_level() -> None:
    assert "errors" in dcp_volumes.__all__
    for name in errors.__all__:
        assert name in dcp_volumes.__all__, name
        assert getattr(dcp_volumes, name) is getattr(errors, name)
    assert issubclass(dcp_volumes.CheckpointNotFoundError, dcp_volumes.DCPVolumesError)
    with pytest.raises(FileNotFoundError):  # a leaf is still the builtin a caller catches
        raise dcp_volumes.CheckpointNotFoundError("no checkpoint at file:///x")


def test_the_hierarchy_has_one_root() -> None:
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(c, errors.DCPVolumesError) for c in classes)
    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, BaseException)
               and value.__module__ == errors.__name__}
    assert defined == set(errors.__all__), "an error class is missing from errors.__all__"


def test_import_stays_cheap() -> None:
    code = ("import sys\n"
            "import dcp_volumes\n"
            "from dcp_volumes import DCPVolumesError, IntegrityError\n"
            "assert dcp_volumes.errors.IntegrityError is IntegrityError\n"
            "assert 'torch' not in sys.modules, 'import dcp_volumes imported torch'\n"
            "assert 'fsspec' not in sys.modules, 'import dcp_volumes imported fsspec'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def _packages() -> list[str]:
    # huggingface's VolumeTrainer imports transformers (~15 s here); its own tests import it
    return ["dcp_volumes"] + sorted(
        m.name for m in pkgutil.walk_packages(dcp_volumes.__path__, "dcp_volumes.")
        if m.ispkg and m.name != "dcp_volumes.integrations.huggingface")


@pytest.mark.parametrize("package", _packages())
def test_every_listed_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    listed = getattr(module, "__all__", [])
    assert len(listed) == len(set(listed)), f"{package}.__all__ lists a name twice"
    missing = [name for name in listed if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ lists names it does not have: {missing}"


def _self_privates(cls: type, *, stored_only: bool = False) -> set[str]:
    """Private names ``cls``'s own source defines (class body) or uses on ``self``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = {n.name for n in tree.body[0].body  # type: ignore[attr-defined]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    on_self = {node.attr for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id == "self"
               and (not stored_only or isinstance(node.ctx, ast.Store))}
    return {n for n in body | on_self if n.startswith("_") and not n.startswith("__")}


def test_safetensors_reader_uses_only_public_seams_of_the_reader() -> None:
    """SafetensorsReader (export) subclasses VolumeReader (the root package): no private name
    it touches on ``self`` is one that VolumeReader or its bases define (before: ``_backend()``
    and ``_url``; now the public ``backend()`` and ``url``)."""
    from dcp_volumes.export import SafetensorsReader
    from dcp_volumes.reader import VolumeReader

    theirs: set[str] = set()
    for cls in VolumeReader.__mro__:
        if cls.__module__.startswith("dcp_volumes."):
            theirs |= _self_privates(cls)
    reached = sorted(_self_privates(SafetensorsReader) & theirs)
    assert not reached, f"SafetensorsReader reaches into VolumeReader's privates: {reached}"
