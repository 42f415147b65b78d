"""Export of a checkpoint written through a custom torch stream transform (issue 26): a
``Rot13Example``-style ``StreamTransformExtension`` registered in torch's ``ExtensionRegistry``
is decoded by ``export_safetensors(..., extension_registry=)`` and ``dcp-volumes export
--extension MODULE:CLASS``, from SeaweedFS, with load's bounds: without the extension the
export fails before any fetch naming the transform and what to pass; a transform that
decodes without end stops at the bound; a ``.metadata`` claiming more than the stored bytes
can decode to is refused before any work.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli import run_cli
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter

from dcp_volumes import errors
from dcp_volumes.export import export_safetensors
from dcp_volumes.testing.suite import Store

_extension = pytest.importorskip("torch.distributed.checkpoint._extension")
from _rot13 import Endless, Rot13Example

pytestmark = pytest.mark.xdist_group("export")
HERE = Path(__file__).resolve().parent


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.arange(9).to(torch.bfloat16)}


def _registry(*extensions: type) -> Any:
    reg = _extension.ExtensionRegistry()
    for cls in extensions:
        reg.register(cls)
    return reg


@pytest.fixture(scope="module")
def rot13(seaweedfs: Any) -> tuple[Store, str, str]:
    """The checkpoint torch's FileSystemWriter wrote through Rot13Example: its local
    directory, and its copy uploaded to SeaweedFS behind the exporter's back."""
    local = tempfile.mkdtemp(prefix="export-rot13-")
    dcp.save({"model": _state()}, no_dist=True,
             storage_writer=FileSystemWriter(local, _extensions=[Rot13Example()]))
    store = seaweedfs.store()
    url = store.url("rot13")
    store.raw_fs.put(local + "/", store.raw_path(url), recursive=True)
    return store, local, url


def test_rot13_checkpoint_exports_from_seaweedfs_equal(rot13: tuple[Store, str, str],
                                                       seaweedfs: Any, tmp_path: Path) -> None:
    store, _, url = rot13
    report = export_safetensors(url, tmp_path / "hf", prefix="model.",
                                storage_options=store.storage_options,
                                extension_registry=_registry(Rot13Example))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == {"w", "b"} and report.tensors == 2
    assert all(torch.equal(got[k], v) for k, v in _state().items())
    out = run_cli("export", url, str(tmp_path / "cli"), "--prefix", "model.", "--extension",
                  "_rot13:Rot13Example", env={**seaweedfs.server.env(), "PYTHONPATH": os.pathsep
                                              .join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    assert torch.equal(load_file(tmp_path / "cli" / "model.safetensors")["w"], _state()["w"])


def test_a_missing_extension_fails_before_any_fetch_saying_what_to_pass(
        rot13: tuple[Store, str, str], seaweedfs: Any, tmp_path: Path) -> None:
    store, _, url = rot13
    for registry in (None, _registry()):
        with pytest.raises(errors.UnsupportedTransformError,
                           match="stream.rot13/1.*extension_registry=registry.*--extension"):
            export_safetensors(url, tmp_path / "hf", prefix="model.",
                               storage_options=store.storage_options,
                               extension_registry=registry)
    assert not (tmp_path / "hf").exists() or not list((tmp_path / "hf").iterdir())
    out = run_cli("export", url, str(tmp_path / "cli"), "--prefix", "model.",
                  env=seaweedfs.server.env())
    assert out.returncode == 1 and "--extension MODULE:CLASS" in out.stderr, out.stderr
    out = run_cli("export", url, str(tmp_path / "cli"), "--prefix", "model.", "--extension",
                  "no_such_module:Rot13", env=seaweedfs.server.env())
    assert out.returncode == 2 and "cannot be registered" in out.stderr, out.stderr


def _crafted(local: str, edit: Any) -> str:
    dst = tempfile.mkdtemp(prefix="export-rot13-crafted-")
    shutil.copytree(local, dst, dirs_exist_ok=True)
    metadata = pickle.loads((Path(dst) / ".metadata").read_bytes())  # test-made: trusted
    edit(metadata)
    (Path(dst) / ".metadata").write_bytes(pickle.dumps(metadata))
    return dst


def test_transforms_keep_loads_bounds(rot13: tuple[Store, str, str], tmp_path: Path) -> None:
    _, local, _ = rot13

    def endless(md: Any) -> None:
        for k, v in md.storage_data.items():
            md.storage_data[k] = type(v)(v.relative_path, v.offset, v.length,
                                         ["stream.endless/1"])

    with pytest.raises(errors.IntegrityError, match="decodes to more than the"):
        export_safetensors(_crafted(local, endless), tmp_path / "a", prefix="model.",
                           storage_options={}, extension_registry=_registry(Endless))

    def huge(md: Any) -> None:  # a consistent lie: 10**12 elements from a few KiB
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        w = md.state_dict_metadata["model.w"]
        info = md.storage_data.pop(next(k for k in md.storage_data if k.fqn == "model.w"))
        w.size = torch.Size([10**6, 10**6])
        w.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=w.size)]
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md.storage_data[MetadataIndex("model.w", torch.Size([0, 0]))] = info

    with pytest.raises(errors.IntegrityError, match="claims a chunk of 10{12} elements"):
        export_safetensors(_crafted(local, huge), tmp_path / "b", prefix="model.",
                           storage_options={}, extension_registry=_registry(Rot13Example))
