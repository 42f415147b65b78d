"""Torch's compressed checkpoints (``FileSystemWriter(_extensions=[ZStandard()])``) through
``VolumeReader``: decoded, bounded, checked; typed errors where they cannot be read.

- tensors (f32, bf16, a sliced load) and non-tensor items load equal on ``file://`` and on
  SeaweedFS (the directory uploaded behind the reader's back);
- a flipped byte in the compressed data, a frame that claims or inflates to far more than its
  tensor needs (a zip bomb): ``IntegrityError``;
- ``zstandard``/``pyzstd`` not importable (a subprocess where the import fails), an unknown
  descriptor, an unknown version: ``UnsupportedTransformError`` naming the transform and
  what to install — never torch's unpickler error or an ``UnsafeCheckpointError`` naming "?".
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

from dcp_volumes import errors
from dcp_volumes._api import load as typed_load

pytestmark = pytest.mark.xdist_group("streader")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state(zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    s: dict[str, Any] = {
        "w": torch.arange(60_000, dtype=torch.float32).reshape(200, 300),  # compressible
        "noise": torch.randn(50, 70, generator=g).to(torch.bfloat16),
        "step": 17,
        "extra": {"name": "zstd", "lr": [0.1, 0.01]},
    }
    if zeros:
        s = {"w": torch.zeros(200, 300), "noise": torch.zeros(50, 70, dtype=torch.bfloat16),
             "step": 0, "extra": {"name": "", "lr": [0.0, 0.0]}}
    return s


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
               for k, v in want.items())


@pytest.fixture(scope="module")
def compressed() -> str:
    d = tempfile.mkdtemp(prefix="streader-zstd-")
    dcp.save(state(), storage_writer=FileSystemWriter(d, _extensions=[ZStandard()]),
             no_dist=True)
    return d


def _copy(src: str) -> str:
    dst = tempfile.mkdtemp(prefix="streader-zstd-")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _metadata(d: str) -> Any:
    with open(f"{d}/.metadata", "rb") as f:
        return pickle.load(f)  # our own test file: trusted


def _write_metadata(d: str, md: Any) -> None:
    with open(f"{d}/.metadata", "wb") as f:
        pickle.dump(md, f)


def _item(md: Any, fqn: str) -> Any:
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def test_loads_equal_on_local_files_and_seaweedfs(compressed: str, seaweedfs: Any) -> None:
    assert all(info.transform_descriptors == ["stream.zstd/1"]
               for info in _metadata(compressed).storage_data.values())
    store = seaweedfs.store()
    url = store.url("zstd")
    store.raw_fs.put(compressed + "/", store.raw_path(url), recursive=True)
    for where, options in (("file://" + compressed, {}), (url, store.storage_options)):
        target = state(zeros=True)
        reader = typed_load(target, where, storage_options=options, no_dist=True)
        assert _equal(target, state()), where
        assert reader.last_stats is not None and reader.last_stats.bytes_fetched > 0
    # a resharding load: a slice of a compressed tensor (the item is decoded whole)
    from torch.distributed.checkpoint import DefaultLoadPlanner
    part = {"w": torch.zeros(200, 300)}
    typed_load(part, url, storage_options=store.storage_options, no_dist=True,
               planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["w"], state()["w"])


def test_damaged_and_bomb_items_are_integrity_errors(compressed: str) -> None:
    d = _copy(compressed)
    info = _item(_metadata(d), "w")
    path = f"{d}/{info.relative_path}"
    with open(path, "rb") as f:
        original = f.read()
    # flipped bytes: in the frame header, in the compressed block, near the end
    for pos in (info.offset + 5, info.offset + info.length // 2, info.offset + info.length - 3):
        blob = bytearray(original)
        blob[pos] ^= 0x5A
        with open(path, "wb") as f:
            f.write(blob)
        with pytest.raises(errors.IntegrityError):
            typed_load(state(zeros=True), d, no_dist=True)
    # zip bombs: 256 MiB of zeros in a few KiB, where the tensor needs 240 KB
    zeros = bytes(256 * 2**20)
    for claims in (True, False):
        bomb = zstandard.ZstdCompressor(write_content_size=claims).compress(zeros) \
            if claims else _stream_compress(zeros)
        assert len(bomb) < 64 * 2**10
        with open(path, "wb") as f:
            f.write(original + bomb)  # the item now points at the bomb, after the others
        md = _metadata(d)
        for k, v in md.storage_data.items():
            if k.fqn == "w":
                md.storage_data[k] = type(v)(v.relative_path, len(original), len(bomb),
                                             v.transform_descriptors)
        _write_metadata(d, md)
        with pytest.raises(errors.IntegrityError, match="more than the"):
            typed_load(state(zeros=True), d, no_dist=True)


def _stream_compress(data: bytes) -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as w:
        w.write(data)
    return out.getvalue()


def test_unknown_transforms_are_typed(compressed: str) -> None:
    for descriptor, says in (("stream.lz4/1", "stream.lz4"),
                             ("stream.zstd/2", "version '2'")):
        d = _copy(compressed)
        md = _metadata(d)
        for k, v in md.storage_data.items():
            md.storage_data[k] = type(v)(v.relative_path, v.offset, v.length, [descriptor])
        _write_metadata(d, md)
        with pytest.raises(errors.UnsupportedTransformError, match=says):
            typed_load(state(zeros=True), d, no_dist=True)


def test_without_a_zstd_package_the_error_says_what_to_install(compressed: str) -> None:
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.modules["zstandard"] = None  # the import fails, as when it is not installed
        sys.modules["pyzstd"] = None
        warnings.filterwarnings("ignore")
        import torch
        from dcp_volumes import errors
        from dcp_volumes._api import load
        target = {{"w": torch.zeros(200, 300), "noise": torch.zeros(50, 70,
                  dtype=torch.bfloat16), "step": 0, "extra": {{"name": "", "lr": [0.0, 0.0]}}}}
        try:
            load(target, {compressed!r}, no_dist=True)
        except errors.UnsupportedTransformError as exc:
            print("TYPED", exc)
        except BaseException as exc:
            print("OTHER", type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                         text=True,
                         timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.startswith("TYPED"), out.stdout + out.stderr
    assert "stream.zstd" in out.stdout and "pip install zstandard" in out.stdout


def _ranks_load(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    from dcp_volumes import VolumeReader
    from dcp_volumes._api import typed_errors

    target = state(zeros=True)
    reader = VolumeReader(url, storage_options=options)
    with typed_errors(lambda: reader.last_error):
        dcp.load(target, storage_reader=reader)
    stats = reader.last_stats.as_dict() if reader.last_stats else {}
    return {"equal": _equal(target, state()), **stats}


def test_replicated_load_on_two_ranks_is_cooperative(compressed: str, seaweedfs: Any) -> None:
    from dcp_volumes.testing.dist import run_ranks

    store = seaweedfs.store()
    url = store.url("zstd")
    store.raw_fs.put(compressed + "/", store.raw_path(url), recursive=True)
    results = run_ranks(2, _ranks_load, url, store.storage_options, timeout=120)
    assert all(r["equal"] and r["cooperative"] for r in results), results
    stored = sum(info.length for info in _metadata(compressed).storage_data.values())
    assert sum(r["bytes_fetched"] for r in results) <= 1.05 * stored  # each byte once
