"""Crafted safetensors headers and indexes: typed errors, and no large read or allocation.

Each header goes through ``_format.read_header`` with a ``fetch`` that counts the bytes
it was asked for, so "no large read" is measured, not assumed. Indexes and whole files go
through :class:`~dcp_volumes.export.SafetensorsReader` on ``memory://``, written
behind the reader's back with a raw fsspec filesystem.
"""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import fsspec
import pytest
import torch
from safetensors.torch import save

from dcp_volumes import errors
from dcp_volumes.export import SafetensorsReader, _format

pytestmark = pytest.mark.xdist_group("streader")

GOOD = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}


def _file(doc: Any, data_len: int = 24, *, length: int | None = None) -> bytes:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + b"\0" * data_len


def _read(blob: bytes) -> tuple[Exception | _format.Header, int]:
    asked = [0]

    def fetch(start: int, end: int) -> bytes:
        asked[0] += end - start
        return blob[start:end]

    try:
        return _format.read_header(fetch, len(blob), "t.safetensors"), asked[0]
    except errors.DCPVolumesError as exc:
        return exc, asked[0]


CRAFTED = {
    "past-the-end": _file({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, 8),
    "overlap": _file({"a": GOOD, "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}),
    "header-2**63": _file({"a": GOOD}, length=2**63),
    "header-past-size": _file({"a": GOOD}, length=10_000),
    "shape-2**80": _file({"a": {"dtype": "U8", "shape": [2**40, 2**40],
                                "data_offsets": [0, 2**80]}}),
    "length-vs-shape": _file({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}),
    "unknown-dtype": _file({"a": {"dtype": "F128", "shape": [2], "data_offsets": [0, 32]}}, 32),
    "duplicate": b'{"a": ' + json.dumps(GOOD).encode() + b', "a": '
                 + json.dumps(GOOD).encode() + b"}",
    "non-json": _file(b"{not json at all"),
    "not-an-object": _file(b"[1, 2, 3]"),
    "negative": _file({"a": {"dtype": "F32", "shape": [-2, 3], "data_offsets": [0, 24]}}),
    "reversed-offsets": _file({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}),
    "bool-dim": _file({"a": {"dtype": "F32", "shape": [True, 6], "data_offsets": [0, 24]}}),
    "extra-field": _file({"a": {**GOOD, "x": 1}}),
    "truncated-file": _file({"a": GOOD})[:20],
    "shorter-than-8": b"\x05\0\0",
}
CRAFTED["duplicate"] = _file(CRAFTED["duplicate"])


@pytest.mark.parametrize("name", list(CRAFTED), ids=list(CRAFTED))
def test_crafted_header_is_integrity_error_without_a_large_read(name: str) -> None:
    blob = CRAFTED[name]
    got, asked = _read(blob)
    assert isinstance(got, errors.IntegrityError), (name, got)
    assert "t.safetensors" in str(got)
    # the 8-byte prefix, and at most the (small) header the object really holds
    assert asked <= 8 + len(blob), (name, asked)


def test_a_good_header_parses() -> None:
    blob = save({"w": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)})
    got, asked = _read(blob)
    assert isinstance(got, _format.Header)
    assert {e.name: (e.torch_dtype, e.shape) for e in got.entries} == {
        "w": ("float32", (2, 3)), "b": ("bfloat16", (4,))}
    assert asked == got.data_start


# ---- indexes and files through the reader (memory://, written behind its back) -----------
@pytest.fixture
def mem() -> tuple[str, Any]:
    root = f"memory://st-{uuid.uuid4().hex[:8]}"
    return root, fsspec.filesystem("memory")


def _meta_error(url: str, **kw: Any) -> errors.DCPVolumesError:
    with pytest.raises(errors.DCPVolumesError) as info:
        SafetensorsReader(url, **kw).read_metadata()
    return info.value


def test_crafted_indexes_and_files_give_typed_errors(mem: tuple[str, Any]) -> None:
    root, fs = mem
    good = save({"w": torch.ones(2, 3)})
    fs.pipe(f"{root}/ok/model.safetensors", good)
    cases = {
        "../escape.safetensors": errors.UnsafeCheckpointError,
        "/abs/x.safetensors": errors.UnsafeCheckpointError,
        "s3://other/x.safetensors": errors.UnsafeCheckpointError,
        "sub/x.safetensors": errors.UnsafeCheckpointError,
        "model.bin": errors.UnsafeCheckpointError,
        "missing.safetensors": errors.IntegrityError,
    }
    for i, (target, kind) in enumerate(cases.items()):
        d = f"{root}/idx{i}"
        fs.pipe(f"{d}/model.safetensors", good)
        fs.pipe(f"{d}/model.safetensors.index.json",
                json.dumps({"weight_map": {"w": target}}).encode())
        err = _meta_error(d)
        assert isinstance(err, kind), (target, err)
    # the index names a tensor its file does not have
    fs.pipe(f"{root}/idx-x/model.safetensors", good)
    fs.pipe(f"{root}/idx-x/model.safetensors.index.json",
            json.dumps({"weight_map": {"nope": "model.safetensors"}}).encode())
    assert "does not have it" in str(_meta_error(f"{root}/idx-x"))
    for body in (b"[]", b"{not json", json.dumps({"weight_map": {}}).encode()):
        fs.pipe(f"{root}/idx-bad/model.safetensors.index.json", body)
        assert isinstance(_meta_error(f"{root}/idx-bad"), errors.IntegrityError)
    # a crafted header in the store: typed, before any tensor byte
    fs.pipe(f"{root}/crafted/model.safetensors", CRAFTED["header-2**63"])
    assert isinstance(_meta_error(f"{root}/crafted"), errors.IntegrityError)
    fs.mkdir(f"{root}/empty")
    fs.pipe(f"{root}/empty/readme.txt", b"x")
    assert isinstance(_meta_error(f"{root}/empty"), errors.CheckpointNotFoundError)


def test_keys_and_options(mem: tuple[str, Any]) -> None:
    root, fs = mem
    fs.pipe(f"{root}/m/model.safetensors", save({"a": torch.ones(1), "b": torch.zeros(2)}))
    md = SafetensorsReader(f"{root}/m/model.safetensors", prefix="model.").read_metadata()
    assert set(md.state_dict_metadata) == {"model.a", "model.b"}
    md = SafetensorsReader(f"{root}/m", key_map=lambda n: None if n == "a" else "x." + n
                           ).read_metadata()
    assert set(md.state_dict_metadata) == {"x.b"}
    assert isinstance(_meta_error(f"{root}/m", key_map=lambda n: "same"), errors.ConfigError)
    assert isinstance(_meta_error(f"{root}/m", key_map=lambda n: 3), errors.ConfigError)
    with pytest.raises(errors.ConfigError):
        SafetensorsReader(f"{root}/m", prefix="p.", key_map=lambda n: n)


def test_a_stored_manifest_cannot_switch_checks_off() -> None:
    from dcp_volumes._manifest import ItemEntry, Manifest

    layout = {"data": 0, "block": 4, "crcs": [1], "shape": [1], "dtype": "float32",
              "checked": False}
    doc = {"format": 1, "save_id": "x", "files": {"f": {"size": 8, "items": [
        [0, 4, 7, layout], [4, 4, 9]]}}}
    manifest = Manifest.from_json(json.dumps(doc).encode(), where="m")
    assert all(e.checked for e in manifest.files["f"].items.values())
    raw = ItemEntry.raw(8, "float32", (2,), 4)
    assert not raw.checked
    with pytest.raises(errors.DCPVolumesError):
        raw.to_json(0)  # never written to a manifest
