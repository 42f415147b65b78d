"""Torch checkpoints written through a custom stream transform (a ``StreamTransformExtension``
registered in torch's ``ExtensionRegistry``, torch's ``Rot13Example`` style) load through
``VolumeReader(..., extension_registry=)``, decoded after the checks and bounded like zstd's
(issue 26, "drop-in where users already have tests").

- equal values on ``file://`` and on SeaweedFS (the directory uploaded behind the reader's
  back). (Not chained with ZStandard: torch 2.13's own FileSystemReader cannot read a chain
  of two transforms its FileSystemWriter wrote — the descriptors are listed in the order
  torch's reader does not undo them — so the order torch's reader uses is kept here.)
- without a registry, with one that lacks the transform, or at an unknown version:
  ``UnsupportedTransformError`` before any byte is fetched;
- a transform whose stream never ends (or inflates past what the item's metadata allows)
  is stopped at the bound: ``IntegrityError``, not memory exhaustion; a transform that
  raises on damaged bytes: ``IntegrityError``.
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
import warnings
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_volumes import VolumeReader, errors
from dcp_volumes._api import load as typed_load

try:  # torch's extension registry (experimental in torch; absent from some versions)
    from torch.distributed.checkpoint._extension import ExtensionRegistry
except ImportError:  # pragma: no cover - depends on the torch version
    pytest.skip("this torch has no torch.distributed.checkpoint._extension (ExtensionRegistry)",
                allow_module_level=True)

# the transforms themselves are shared with the export tests (tests/integration/_rot13.py)
from _rot13 import Endless, Rot13Example

pytestmark = pytest.mark.xdist_group("streader")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

class Strict(Rot13Example):
    """A transform that refuses damaged input (as an authenticated cipher would)."""

    @staticmethod
    def from_descriptor(version: str) -> Strict:
        return Strict()

    @staticmethod
    def registry_name() -> str:
        return "stream.strict"

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        raise ValueError("authentication tag mismatch")


def registry(*extensions: type) -> ExtensionRegistry:
    reg = ExtensionRegistry()
    for cls in extensions:
        reg.register(cls)
    return reg


def state(zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    if zeros:
        return {"w": torch.zeros(64, 80), "b": torch.zeros(7, dtype=torch.bfloat16),
                "step": 0, "extra": {"name": "", "lr": [0.0]}}
    return {"w": torch.randn(64, 80, generator=g), "b": torch.arange(7).to(torch.bfloat16),
            "step": 42, "extra": {"name": "Rot13 Example", "lr": [0.5]}}


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
               for k, v in want.items())


def _write(extensions: list[Any]) -> str:
    d = tempfile.mkdtemp(prefix="streader-ext-")
    dcp.save(state(), storage_writer=FileSystemWriter(d, _extensions=extensions), no_dist=True)
    return d


@pytest.fixture(scope="module")
def rot13() -> str:
    return _write([Rot13Example()])


def _descriptors(d: str, descriptor: str | None = None) -> set[tuple[str, ...]]:
    """The items' descriptors (replaced by ``[descriptor]`` on a copy's items, if given)."""
    with open(f"{d}/.metadata", "rb") as f:
        md = pickle.load(f)  # our own test file: trusted
    if descriptor is not None:
        for k, v in md.storage_data.items():
            md.storage_data[k] = type(v)(v.relative_path, v.offset, v.length, [descriptor])
        with open(f"{d}/.metadata", "wb") as f:
            pickle.dump(md, f)
    return {tuple(v.transform_descriptors) for v in md.storage_data.values()}


def _copy(src: str, descriptor: str | None = None) -> str:
    dst = tempfile.mkdtemp(prefix="streader-ext-")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    _descriptors(dst, descriptor)
    return dst


def test_rot13_loads_equal_on_local_files_and_seaweedfs(rot13: str, seaweedfs: Any) -> None:
    assert _descriptors(rot13) == {("stream.rot13/1",)}
    store = seaweedfs.store()
    url = store.url("rot13")
    store.raw_fs.put(rot13 + "/", store.raw_path(url), recursive=True)
    for where, options in (("file://" + rot13, {}), (url, store.storage_options)):
        target = state(zeros=True)
        reader = VolumeReader(where, storage_options=options,
                              extension_registry=registry(Rot13Example))
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert _equal(target, state()), where
        assert reader.last_stats is not None and reader.last_stats.bytes_fetched > 0


def test_unregistered_transforms_are_typed(rot13: str) -> None:
    with pytest.raises(errors.UnsupportedTransformError, match="extension_registry="):
        typed_load(state(zeros=True), rot13, no_dist=True)
    with pytest.raises(errors.UnsupportedTransformError, match="is its extension registered"):
        typed_load(state(zeros=True), rot13, no_dist=True, extension_registry=registry())
    with pytest.raises(errors.UnsupportedTransformError, match="stream.rot13/2"):
        typed_load(state(zeros=True), _copy(rot13, "stream.rot13/2"), no_dist=True,
                   extension_registry=registry(Rot13Example))
    with pytest.raises(errors.ConfigError, match="ExtensionRegistry"):
        VolumeReader(rot13, extension_registry={"stream.rot13": Rot13Example})


def test_endless_and_failing_transforms_are_integrity_errors(rot13: str) -> None:
    with pytest.raises(errors.IntegrityError, match="more than the"):
        typed_load(state(zeros=True), _copy(rot13, "stream.endless/1"), no_dist=True,
                   extension_registry=registry(Endless))
    with pytest.raises(errors.IntegrityError, match="cannot be decoded"):
        typed_load(state(zeros=True), _copy(rot13, "stream.strict/1"), no_dist=True,
                   extension_registry=registry(Strict))
