"""Crafted inputs on the load side reach the caller as typed errors (issue 25, findings 6, 8
and 9): one table of inputs, each with the ``DCPVolumesError`` subclass it must raise.

A real checkpoint is saved on local disk by ``dcp_volumes.save``, then changed behind the
reader's back (``.metadata`` re-pickled, the manifest rewritten, a FIFO put in a file's place)
and loaded through ``dcp_volumes.load``; safetensors headers and zstd frames go through the
functions that parse them. Before these fixes each row raised a builtin (``KeyError``,
``IndexError``, ``ValueError``, ``RecursionError``, ``MemoryError``), hung, or loaded wrong
values with ``verified=True``. Issue 37, finding 7 added rows: a ``.metadata`` shape that
does not match the stored chunk (was ``IndexError: Dimension out of range``, or the first
elements of a larger tensor loaded as the whole), and a compressed item whose
``transform_descriptors`` are empty or gone (was torch's "Unsupported operand 181").
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

import dcp_volumes
from dcp_volumes import SafetensorsReader, VolumeReader, errors
from dcp_volumes._compat import no_dist
from dcp_volumes.export import _format
from dcp_volumes.transfer import transforms

BIG = 2**20  # float32 elements: 4 MiB, stored with a block layout (dtype in the manifest)


def _state(fill: float | None = None) -> dict[str, Any]:
    big = torch.arange(BIG, dtype=torch.float32) + 0.5
    small = torch.arange(4, dtype=torch.float32) + 0.5
    if fill is not None:
        big, small = torch.full_like(big, fill), torch.full_like(small, fill)
    return {"big": big, "small": small, "obj": {"step": 7 if fill is None else 0}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("crafted") / "base"
    dcp_volumes.save(_state(), str(path), no_dist=True)
    return path


# ---- how each input is crafted ------------------------------------------------------------
def _metadata(change: Callable[[Any], None]) -> Callable[[Path], None]:
    def craft(path: Path) -> None:
        md = pickle.loads((path / ".metadata").read_bytes())
        change(md)
        (path / ".metadata").write_bytes(pickle.dumps(md))
    return craft


def _tensor(fqn: str, **fields: Any) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        item = md.state_dict_metadata[fqn]
        for name, value in fields.items():
            if name == "dtype":
                item.properties.dtype = value
            elif name in ("offsets", "sizes"):
                setattr(item.chunks[0], name, torch.Size(value))
            else:
                setattr(item, name, value)
    return change


def _locations(**fields: Any) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        for info in md.storage_data.values():
            for name, value in fields.items():
                setattr(info, name, value)
    return change


def _manifest_dtype(path: Path) -> None:
    (manifest,) = path.glob(".dcpv-manifest-*")
    doc = json.loads(manifest.read_bytes())
    for entry in doc["files"].values():
        for row in entry["items"]:
            if len(row) > 3:
                row[3]["dtype"] = "int32"  # the float32 item's bytes read as int32
    manifest.write_text(json.dumps(doc))


def _manifest_shape(path: Path) -> None:
    (manifest,) = path.glob(".dcpv-manifest-*")
    doc = json.loads(manifest.read_bytes())
    for entry in doc["files"].values():
        for row in entry["items"]:
            if len(row) > 3:
                row[3]["shape"] = [0, 10**30]  # no bytes, so it fits its item
    manifest.write_text(json.dumps(doc))


def _reshaped(size: list[int], offsets: list[int]) -> Callable[[Any], None]:
    """Item "small" (stored whole as a ``torch.save`` of shape [4]) claimed as ``size``, in
    one chunk at ``offsets``, its stored location re-keyed to match: every number in
    ``.metadata`` agrees; only the stored tensor does not."""
    def change(md: Any) -> None:
        item = md.state_dict_metadata["small"]
        item.size = torch.Size(size)
        item.chunks[0].offsets, item.chunks[0].sizes = torch.Size(offsets), torch.Size(size)
        (index,) = [i for i in md.storage_data if i.fqn == "small"]
        md.storage_data[MetadataIndex("small", torch.Size(offsets))] = md.storage_data.pop(index)
    return change


def _compressed(fqn: str, descriptors: list[str] | None) -> Callable[[Path], None]:
    """The state saved by torch's writer with its ZStandard extension instead, then
    ``fqn``'s ``transform_descriptors`` set to ``descriptors`` (torch writes None only when
    no transform was applied)."""
    def craft(path: Path) -> None:
        shutil.rmtree(path)
        dcp.save(_state(), storage_writer=FileSystemWriter(str(path), _extensions=[ZStandard()]),
                 no_dist=True)

        def change(md: Any) -> None:
            for index, info in md.storage_data.items():
                if index.fqn == fqn:
                    info.transform_descriptors = descriptors
        _metadata(change)(path)
    return craft


def _fifo(pattern: str) -> Callable[[Path], None]:
    def craft(path: Path) -> None:
        (victim,) = path.glob(pattern)
        victim.unlink()
        os.mkfifo(victim)
    return craft


LOADS: dict[str, tuple[Callable[[Path], None], type[errors.DCPVolumesError]]] = {
    # finding 9: numbers and structure of .metadata that reached torch's planner
    "shape-[0,10**30]": (_metadata(_tensor("small", size=torch.Size([0, 10**30]))),
                         errors.IntegrityError),
    "shape-bytes-overflow": (_metadata(_tensor("small", size=torch.Size([2**62, 2**62]))),
                             errors.IntegrityError),
    "chunk-outside-tensor": (_metadata(_tensor("small", offsets=[5])), errors.IntegrityError),
    "chunk-dims-mismatch": (_metadata(_tensor("small", offsets=[])), errors.IntegrityError),
    "chunk-without-location": (_metadata(lambda md: md.storage_data.clear()),
                               errors.IntegrityError),
    "chunks-missing": (_metadata(_tensor("small", chunks=[])), errors.IntegrityError),
    "no-dtype": (_metadata(_tensor("small", properties=None)), errors.IntegrityError),
    "items-not-a-map": (_metadata(lambda md: setattr(md, "state_dict_metadata", [])),
                        errors.IntegrityError),
    "offset-not-an-int": (_metadata(_locations(offset="x")), errors.IntegrityError),
    # finding 6: a chunk claiming more than its tensor (what a decode bound was taken from)
    "chunk-larger-than-tensor": (_metadata(_tensor("small", sizes=[10**12])),
                                 errors.IntegrityError),
    # finding 8: a dtype that lies, in .metadata or in the manifest
    "metadata-dtype-lies-layout": (_metadata(_tensor("big", dtype=torch.int32)),
                                   errors.IntegrityError),
    "metadata-dtype-lies-whole": (_metadata(_tensor("small", dtype=torch.int32)),
                                  errors.IntegrityError),
    "manifest-dtype-lies": (_manifest_dtype, errors.IntegrityError),
    "manifest-shape-[0,10**30]": (_manifest_shape, errors.IntegrityError),
    # finding 6: a FIFO where a file belongs hung the reader
    "fifo-metadata": (_fifo(".metadata"), errors.UnsafeCheckpointError),
    "fifo-manifest": (_fifo(".dcpv-manifest-*"), errors.UnsafeCheckpointError),
    # shard sizes come from the manifest (one commit read per job), so the FIFO is opened
    "fifo-shard": (_fifo("__0_0-*.distcp"), errors.UnsafeCheckpointError),
    # issue 37, finding 7: a shape that does not match the stored chunk (the caller's tensor
    # has the claimed shape, so torch's planner lets it through)
    "shape-[2,2]-stored-[4]": (_metadata(_reshaped([2, 2], [0, 0])), errors.IntegrityError),
    "shape-[2]-stored-[4]": (_metadata(_reshaped([2], [0])), errors.IntegrityError),
    # issue 37, finding 7: a compressed item whose descriptors are empty or gone
    "descriptors-empty-tensor": (_compressed("small", []), errors.IntegrityError),
    "descriptors-empty-object": (_compressed("obj.step", []), errors.IntegrityError),
    "descriptors-gone-tensor": (_compressed("big", None), errors.IntegrityError),
}

#: what a row's message must say, where the class alone does not tell the cause
MESSAGES = {
    "shape-[2,2]-stored-[4]": r"shape \(4,\)",
    "shape-[2]-stored-[4]": r"shape \(4,\)",
    "descriptors-empty-tensor": "descriptors are missing",
    "descriptors-empty-object": "descriptors are missing",
    "descriptors-gone-tensor": "descriptors are missing",
}

#: the caller's state for rows that claim another shape (torch's planner checks it first)
TARGETS: dict[str, Callable[[], dict[str, Any]]] = {
    "shape-[2,2]-stored-[4]": lambda: {**_state(0.0), "small": torch.zeros(2, 2)},
    "shape-[2]-stored-[4]": lambda: {**_state(0.0), "small": torch.zeros(2)},
}


def _unblock_fifos(path: Path) -> None:
    """Open each FIFO for writing once, so a reader blocked on one (the old code) returns."""
    for f in path.iterdir():
        if f.is_fifo():
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                assert exc.errno == errno.ENXIO  # no reader waiting: nothing to unblock


def _raised_within(call: Callable[[], object], path: Path, seconds: float
                   ) -> BaseException | None:
    """What ``call()`` raised (None: nothing); a failure if it blocks ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 — the test checks its class
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _unblock_fifos(path)
        thread.join(30)
        pytest.fail(f"reading {path} did not return within {seconds}s (blocked on a FIFO?)")
    return outcome[0]


@pytest.mark.parametrize("name", list(LOADS), ids=list(LOADS))
def test_crafted_checkpoint_raises_a_typed_error(saved: Path, tmp_path: Path,
                                                 name: str) -> None:
    craft, expected = LOADS[name]
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    craft(path)
    target = TARGETS.get(name, lambda: _state(0.0))()
    raised = _raised_within(lambda: dcp_volumes.load(target, str(path), no_dist=True),
                            path, 60)
    assert isinstance(raised, expected), repr(raised)[:500]
    assert "0.5" not in str(raised)  # no payload values in the message
    if name in MESSAGES:
        assert re.search(MESSAGES[name], str(raised)), str(raised)


def test_an_honest_checkpoint_still_loads(saved: Path) -> None:
    out = _state(0.0)
    reader = dcp_volumes.load(out, str(saved), no_dist=True)
    assert torch.equal(out["big"], _state()["big"]) and out["obj"] == {"step": 7}
    assert reader.last_stats is not None and reader.last_stats.verified


def test_an_empty_chunk_is_accepted_wherever_it_sits(saved: Path, tmp_path: Path) -> None:
    """A rank with no rows of a sharded tensor saves an empty chunk, at the tensor's end (or
    past it): no read overlaps it, so it is not refused as lying outside the tensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _metadata(lambda md: md.state_dict_metadata["small"].chunks.append(
        ChunkStorageMetadata(offsets=torch.Size([9]), sizes=torch.Size([0]))))(path)
    out = _state(0.0)
    dcp_volumes.load(out, str(path), no_dist=True)
    assert torch.equal(out["small"], _state()["small"])


# ---- safetensors headers (finding 9) ------------------------------------------------------
def _header(body: bytes, data: int = 0) -> bytes:
    return struct.pack("<Q", len(body)) + body + b"\0" * data


HEADERS = {
    "deep-json": (_header(b"{" + b'"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
                  errors.IntegrityError),
    "shape-[0,10**30]": (_header(json.dumps({"a": {"dtype": "F32", "shape": [0, 10**30],
                                                   "data_offsets": [0, 0]}}).encode()),
                         errors.IntegrityError),
}


@pytest.mark.parametrize("name", list(HEADERS), ids=list(HEADERS))
def test_crafted_safetensors_header_raises_a_typed_error(tmp_path: Path, name: str) -> None:
    blob, expected = HEADERS[name]
    with pytest.raises(expected):
        _format.read_header(lambda a, b: blob[a:b], len(blob), "t.safetensors")
    (tmp_path / "model.safetensors").write_bytes(blob)
    with pytest.raises(expected):  # and through the documented call, typed
        dcp_volumes.load({"a": torch.zeros(1)}, SafetensorsReader(str(tmp_path)),
                         no_dist=True)


def test_fifo_as_safetensors_index_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    raised = _raised_within(SafetensorsReader(str(tmp_path)).read_metadata, tmp_path, 60)
    assert isinstance(raised, errors.UnsafeCheckpointError) and "FIFO" in str(raised)


# ---- zstd frames (findings 6 and 9) -------------------------------------------------------
def _frame_claiming(size: int) -> bytes:
    """A zstd frame whose header claims ``size`` bytes and whose one block is empty."""
    return (b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", size)
            + b"\x01\x00\x00")


def test_a_frame_claiming_more_than_its_bytes_can_hold_is_refused() -> None:
    # the metadata's limit (4 TB) would allow it: the bytes held bound it (was MemoryError)
    with pytest.raises(errors.IntegrityError, match="claims"):
        transforms.decode(["stream.zstd/1"], memoryview(_frame_claiming(2**40)),
                          limit=4 * 10**12, what="item 'w'")


def test_a_torch_frame_under_a_huge_claimed_limit_decodes_what_it_holds() -> None:
    payload = bytes(range(256)) * 64
    compressor = zstandard.ZstdCompressor().compressobj()  # as torch writes: no size
    frame = compressor.compress(payload) + compressor.flush()
    out = transforms.decode(["stream.zstd/1"], memoryview(frame), limit=4 * 10**12,
                            what="item 'w'")  # was a MemoryError: 4 TB allocated up front
    assert bytes(out) == payload


def test_decode_bound_is_the_smaller_of_the_claim_and_the_format_limit() -> None:
    assert transforms.decode_bound(10**12, 2048) == 2048 * transforms.MAX_RATIO
    assert transforms.decode_bound(100, 2048) == 100
    zeros = zstandard.ZstdCompressor().compress(bytes(64 * 2**20))
    assert transforms.decode_bound(10**12, len(zeros)) >= 64 * 2**20  # an honest best case


# ---- the typed error through plain dcp.load (finding 9) -----------------------------------
def test_plain_dcp_load_carries_the_typed_error(tmp_path: Path) -> None:
    reader = VolumeReader(str(tmp_path / "nothing"))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(1)}, storage_reader=reader, **no_dist())
    failures = [f[0] for f in info.value.failures.values()]
    assert any(isinstance(f, errors.CheckpointNotFoundError) for f in failures), failures
    with pytest.raises(errors.CheckpointNotFoundError):
        dcp_volumes.load({"w": torch.zeros(1)}, reader, no_dist=True)


def test_a_reader_and_reader_options_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="to the reader itself"):
        dcp_volumes.load({}, VolumeReader(str(tmp_path)), verify=False)


def test_an_object_refused_without_a_global_says_why(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    from dcp_volumes.loading.apply import check_object_item

    class _Read:
        storage_index = type("I", (), {"fqn": "obj", "offset": None})()

    blob = pickle.dumps(bytearray(b"abc"), protocol=5)  # an opcode weights_only refuses
    with pytest.raises(errors.DCPVolumesError) as info:
        check_object_item(_Read(), memoryview(blob), ())  # type: ignore[arg-type]
    assert "references ?" not in str(info.value)
