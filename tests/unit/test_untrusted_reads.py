# was tests/unit/test_hardening.py (renamed by subject, issue 24)
"""Everything read from storage is untrusted (issue 10): no code runs from non-tensor items,
crafted metadata and manifests cannot make the reader allocate or fetch what they claim, and
links cannot escape the checkpoint.

Local files and fsspec's memory filesystem. Each test names the finding it guards. URL checks
moved to ``test_url_checks.py``, typed failures to ``test_typed_failures.py``, the dead-spool
cleanup to ``test_spool_failures.py``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

import dcp_volumes
from dcp_volumes import (
    VolumeReader,
    VolumeWriter,
    _commit_read,
    catalog,
    errors,
)
from dcp_volumes._compat import no_dist
from dcp_volumes.backends.local import LocalBackend

MARKER_ENV = "DCPV_TEST_MARKER"


class Payload:
    """An object whose unpickling runs a command (what a hostile ``extra`` item does)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


class Trusted:
    """A plain class a user may choose to trust."""

    def __init__(self, value: int) -> None:
        self.value = value


def _state(extra: object) -> dict[str, object]:
    return {"w": torch.arange(16, dtype=torch.float32), "extra": extra}


# ---- 1. no code from storage through non-tensor items ------------------------------------
@pytest.mark.parametrize("writer", ["stock-torch", "volume-writer"])
def test_object_item_that_runs_code_is_refused(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "ran"
    url = str(tmp_path / "ckpt")
    state = _state(Payload(str(marker)))
    if writer == "stock-torch":
        dcp.save(state, storage_writer=FileSystemWriter(url), **no_dist())
    else:
        dcp.save(state, storage_writer=VolumeWriter(url), **no_dist())
    assert not marker.exists()
    target = _state(None)
    with pytest.raises(errors.UnsafeCheckpointError, match="posix.system|os.system") as info:
        dcp_volumes.load(target, url, no_dist=True)
    assert "safe_globals" in str(info.value)
    assert not marker.exists(), "loading ran a command from storage"


def test_trusted_class_loads_when_allowed(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save(_state(Trusted(7)), storage_writer=VolumeWriter(url), **no_dist())
    with pytest.raises(errors.UnsafeCheckpointError, match="Trusted"):
        dcp_volumes.load(_state(None), url, no_dist=True)
    target = _state(None)
    dcp_volumes.load(target, url, safe_globals=[Trusted], no_dist=True)
    assert isinstance(target["extra"], Trusted) and target["extra"].value == 7
    assert torch.equal(target["w"], torch.arange(16, dtype=torch.float32))


def test_plain_objects_still_load(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    # DCP flattens dicts and lists into keys; what is left are leaf objects of plain types.
    state = {"w": torch.ones(2), "name": "run-7", "step": 3, "lr": 0.5, "flag": None,
             "pair": (1, "a"), "shape": torch.Size([2, 3])}
    dcp.save(state, storage_writer=VolumeWriter(url), **no_dist())
    target = {k: (torch.zeros(2) if k == "w" else None) for k in state}
    dcp_volumes.load(target, url, no_dist=True)
    assert {k: v for k, v in target.items() if k != "w"} == {
        k: v for k, v in state.items() if k != "w"}
    assert torch.equal(target["w"], torch.ones(2))


def test_safe_globals_must_be_a_list() -> None:
    with pytest.raises(errors.ConfigError, match="safe_globals"):
        VolumeReader("/tmp/x", safe_globals="os.system")  # type: ignore[arg-type]


# ---- 2. bounded work on crafted metadata -----------------------------------------------
class _Alloc:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (bytearray, (10**9,))


def test_metadata_cannot_allocate_from_a_size_it_claims(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    url.mkdir()
    (url / ".metadata").write_bytes(pickle.dumps(_Alloc()))
    assert len((url / ".metadata").read_bytes()) < 64
    with pytest.raises(errors.UnsafeCheckpointError, match="bytearray"):
        VolumeReader(str(url)).read_metadata()


def test_oversized_metadata_is_refused_before_reading(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save(_state(1), storage_writer=VolumeWriter(url), **no_dist())
    monkeypatch.setattr(_commit_read, "MAX_METADATA_BYTES", 64)
    reads: list[str] = []
    real_get = LocalBackend._get

    async def counting_get(self, relative, start, end):  # type: ignore[no-untyped-def]
        reads.append(relative)
        return await real_get(self, relative, start, end)

    monkeypatch.setattr(LocalBackend, "_get", counting_get)
    with pytest.raises(errors.UnsafeCheckpointError, match="over the"):
        VolumeReader(url).read_metadata()
    assert reads == []


def _claim_huge_length(url: Path) -> None:
    """Rewrite a torch-written checkpoint's .metadata so one item claims 4 TiB."""
    md: Metadata = pickle.loads((url / ".metadata").read_bytes())
    for index, info in md.storage_data.items():
        if index.fqn == "w":
            md.storage_data[index] = type(info)(info.relative_path, info.offset, 4 << 40)
    (url / ".metadata").write_bytes(pickle.dumps(md))


def test_claimed_length_is_checked_against_the_real_size(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    url = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(1024, dtype=torch.float32)},
             storage_writer=FileSystemWriter(str(url)), **no_dist())
    _claim_huge_length(url)
    shard_gets: list[tuple[int | None, int | None]] = []
    real_get = LocalBackend._get

    async def counting_get(self, relative, start, end):  # type: ignore[no-untyped-def]
        if relative != ".metadata":
            shard_gets.append((start, end))
        return await real_get(self, relative, start, end)

    monkeypatch.setattr(LocalBackend, "_get", counting_get)
    with pytest.raises(errors.IntegrityError, match="truncated or its metadata is damaged"):
        dcp_volumes.load({"w": torch.zeros(1024)}, str(url), no_dist=True)
    assert shard_gets == [], "a GET was issued for a range past the end of its object"


# ---- 3. links cannot escape the checkpoint --------------------------------------------
@pytest.mark.parametrize("how", ["linked-shard", "linked-directory"])
def test_links_out_of_the_checkpoint_are_refused(tmp_path: Path, how: str) -> None:
    outside = tmp_path / "outside"
    dcp.save({"w": torch.arange(8.0)}, storage_writer=FileSystemWriter(str(outside)),
             **no_dist())
    url = tmp_path / "ckpt"
    if how == "linked-shard":
        url.mkdir()
        for f in outside.iterdir():
            target = url / f.name
            if f.name == ".metadata":
                target.write_bytes(f.read_bytes())
            else:
                target.symlink_to(f)
    else:  # the whole checkpoint directory sits under a linked subdirectory
        url.mkdir()
        (url / ".metadata").write_bytes((outside / ".metadata").read_bytes())
        md: Metadata = pickle.loads((outside / ".metadata").read_bytes())
        (url / "sub").symlink_to(outside, target_is_directory=True)
        for index, info in md.storage_data.items():
            md.storage_data[index] = type(info)(f"sub/{info.relative_path}", info.offset,
                                                info.length)
        (url / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
        dcp_volumes.load({"w": torch.zeros(8)}, str(url), no_dist=True)
    report = catalog.verify(str(url))
    assert not report.ok
    assert [f.status for f in report.files] == ["link outside the checkpoint"]


_GOOD_LAYOUT = {"data": 64, "block": 1024, "crcs": [1, 2], "shape": [512], "dtype": "float32"}


@pytest.mark.parametrize("change", [
    {"block": 0}, {"dtype": "os.system"}, {"shape": [-1]}, {"data": 10**6}, {"data": -1},
    {"crcs": [1]}, {"crcs": list(range(10**5))}, {"block": 1023, "crcs": [1, 2, 3]},
    {"created": 10**400},
], ids=["zero-block", "unknown-dtype", "negative-dim", "data-past-item", "negative-data",
        "too-few-crcs", "too-many-crcs", "block-cuts-an-element", "created-10e400"])
def test_crafted_manifest_layouts_are_refused(change: dict[str, object]) -> None:
    from dcp_volumes._manifest import Manifest

    def doc(layout: dict[str, object]) -> bytes:
        import json
        created = layout.pop("created", 1.0)
        return json.dumps({"format": 1, "save_id": "00000000-000000000000", "writer": "x",
                           "world_size": 1, "created": created,
                           "files": {"__0_0-00000000-000000000000.distcp": {
                               "size": 4096, "items": [[0, 4096, 7, layout]]}}}).encode()

    Manifest.from_json(doc(dict(_GOOD_LAYOUT)), where="m")  # the unchanged layout is valid
    with pytest.raises(errors.IntegrityError, match="not valid"):
        Manifest.from_json(doc({**_GOOD_LAYOUT, **change}), where="m")
