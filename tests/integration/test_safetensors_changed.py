"""A safetensors file replaced between the read of its header and the read of its data
(issue 25, finding 4): safetensors carries no checksum, so the reader pins each file's
version when it reads the header (size plus ETag / generation / inode+mtime) and reads the
tensors only from that version. A replaced file fails the load with
``CheckpointChangedError`` (an ``IntegrityError``) instead of loading the new file's bytes at
the old header's offsets (values like 1.28e31 before).

The replacement happens through the reader's public seam (``open_checkpoint``): right after
the headers were read, the file is replaced behind the reader's back (raw filesystem) by a
bigger one — the same tensors behind a longer header, so every offset moved.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save, save_file

from dcp_volumes import errors
from dcp_volumes._api import typed_errors
from dcp_volumes.backends import open_backend
from dcp_volumes.export import SafetensorsReader
from dcp_volumes.reader import Opened

pytestmark = pytest.mark.xdist_group("streader")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(1000, generator=g)}


#: the same tensors behind a header 4 KiB longer: every data offset moves
BIGGER = save(_tensors(), metadata={"pad": "x" * 4096})


class _ReplacedAfterHeaders(SafetensorsReader):
    """Replaces the file (``replace()``) once its header was read and pinned."""

    def __init__(self, url: str, replace: Any, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.replace = replace

    def open_checkpoint(self) -> Opened:
        opened = super().open_checkpoint()
        self.replace()
        return opened


def _load(url: str, options: dict[str, Any], replace: Any) -> dict[str, torch.Tensor]:
    state = {k: torch.zeros_like(v) for k, v in _tensors().items()}
    r = _ReplacedAfterHeaders(url, replace, storage_options=options)
    with typed_errors(lambda: r.last_error):
        dcp.load(state, storage_reader=r, no_dist=True)
    return state


def _unchanged(url: str, options: dict[str, Any]) -> None:
    """Without a replacement the same load gives the saved values (the test's control)."""
    got = _load(url, options, lambda: None)
    assert all(torch.equal(got[k], v) for k, v in _tensors().items())


def test_a_local_file_replaced_by_a_bigger_one_is_refused() -> None:
    d = tempfile.mkdtemp(prefix="st-changed-")
    path = os.path.join(d, "model.safetensors")
    save_file(_tensors(), path)
    _unchanged("file://" + d, {})

    def by_rename() -> None:  # a new inode
        with open(path + ".new", "wb") as f:
            f.write(BIGGER)
        os.replace(path + ".new", path)

    with pytest.raises(errors.CheckpointChangedError, match="changed while it was being read"):
        _load("file://" + d, {}, by_rename)

    save_file(_tensors(), path)

    def in_place() -> None:  # the same inode, rewritten: size and mtime differ
        with open(path, "r+b") as f:
            f.write(BIGGER)

    with pytest.raises(errors.CheckpointChangedError):
        _load("file://" + d, {}, in_place)


def test_a_memory_file_replaced_by_a_bigger_one_is_refused() -> None:
    fs = fsspec.filesystem("memory")
    url = f"memory://st-changed-{os.getpid()}"
    fs.pipe(f"{url}/model.safetensors", save(_tensors()))
    _unchanged(url, {})
    with pytest.raises(errors.CheckpointChangedError):
        _load(url, {}, lambda: fs.pipe(f"{url}/model.safetensors", BIGGER))


@pytest.mark.parametrize("server", ["moto", "seaweedfs", "fake_gcs", "azurite"])
def test_an_object_replaced_by_a_bigger_one_is_refused(server: str,
                                                       request: pytest.FixtureRequest) -> None:
    store = request.getfixturevalue(server).store()
    url = store.url("model")
    fs, path = store.raw_fs, store.raw_path(url) + "/model.safetensors"
    fs.pipe(path, save(_tensors()))
    _unchanged(url, store.storage_options)
    # the store's own conditional read is used: the pin carries its ETag / generation
    backend = open_backend(url, store.storage_options)
    pin = backend.run(lambda: backend.pin("model.safetensors"))
    assert pin is not None and pin.tag and backend.conditional_reads, pin
    with pytest.raises(errors.CheckpointChangedError, match="changed while it was being read"):
        _load(url, store.storage_options, lambda: fs.pipe(path, BIGGER))
    # the error is an IntegrityError too (what callers of load already catch)
    assert issubclass(errors.CheckpointChangedError, errors.IntegrityError)
