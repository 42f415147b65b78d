"""The disk spool with ``O_DIRECT`` (``SpoolOptions.direct_io``): the same bytes, parts and
checksums as the cached spool, whatever the write sizes and part alignment; tmpfs (which
refuses ``O_DIRECT``) falls back to cached writes; whole saves load bit-identical from a
real store (local files; SeaweedFS over S3 in tests/integration/test_spool_direct_s3.py)."""

from __future__ import annotations

import errno
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _direct import direct_supported, spool_roundtrip, spool_state

from dcp_volumes import (
    LocalTierOptions,
    SpoolOptions,
    VolumeReader,
)
from dcp_volumes.errors import ConfigError
from dcp_volumes.saving import PartStream, SpooledPart, SpoolFile

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20






def _spool(directory: Path, part_size: int, pieces: list[bytes], direct: bool
           ) -> tuple[SpoolFile, list[SpooledPart], bytes]:
    sf = SpoolFile("x", mode="disk", directory=str(directory), part_size=part_size,
                   direct=direct)
    sf.begin_item()
    for piece in pieces:
        sf.write(piece)
    sf.end_item()
    sf.close()
    return sf, sf.parts.take(), b"".join(pieces)


@pytest.mark.parametrize("part_size", [5 * MiB, 5 * MiB + 3])
@pytest.mark.parametrize("sizes", [
    [77, 11 * MiB + 5, 5],  # header, a tensor's storage in one write, a tail
    [4096] * 3000,  # many small aligned writes across the 8 MiB buffer
    [1] * 10 + [17 * MiB] + [3] * 7,
    [5 * MiB],  # exactly one part
    [0],  # an empty file
])
def test_direct_spool_matches_the_cached_one(disk_dir: Path, sizes: list[int],
                                             part_size: int) -> None:
    pieces = [os.urandom(n) for n in sizes]
    direct, dparts, whole = _spool(disk_dir / "d", part_size, pieces, True)
    cached, cparts, _ = _spool(disk_dir / "c", part_size, pieces, False)
    try:
        assert direct.direct_io  # it did use O_DIRECT
        assert not cached.direct_io
        assert [p.part for p in dparts] == [p.part for p in cparts]  # number, offset, ..., crc
        assert b"".join(bytes(p.read()) for p in dparts) == whole
        assert [p.part.crc for p in dparts] == [crc32c.crc32c(bytes(p.read()))
                                                for p in dparts]
        assert direct.path is not None
        assert os.path.getsize(direct.path) == len(whole)  # the padding is gone
        with open(direct.path, "rb") as f:
            assert f.read() == whole
    finally:
        direct.discard()
        cached.discard()
    assert direct.path is not None and not os.path.exists(direct.path)


def test_a_part_goes_out_only_once_written(disk_dir: Path) -> None:
    """Parts are handed out while the file is still being written, and each one handed out
    is already readable in full."""
    seen: list[bytes] = []

    class ReadAtOnce(PartStream):
        """Reads each part the moment the spool hands it out."""

        def put(self, part: SpooledPart) -> None:
            seen.append(bytes(part.read()))

    sf = SpoolFile("x", mode="disk", directory=str(disk_dir), part_size=5 * MiB,
                   direct=True, parts=ReadAtOnce())
    pieces = [os.urandom(MiB) for _ in range(23)]
    sf.begin_item()
    for i, piece in enumerate(pieces):
        sf.write(piece)
        if i == 15:
            assert len(seen) >= 1  # uploads start before the file is complete
    sf.end_item()
    sf.close()
    try:
        assert b"".join(seen) == b"".join(pieces)
    finally:
        sf.discard()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "cached"])
def test_parts_are_read_back_into_reused_buffers(disk_dir: Path, direct: bool) -> None:
    """Issue 28: a part read back for upload is a view of a pooled buffer (no copy, no fresh
    pages per part); once the part is done the next one reuses it, but never while any view
    of it is alive (a request body a client still holds), and the pool is emptied when the
    last spool file closes."""
    from dcp_volumes.saving._spool_direct import READ_BUFFERS

    pieces = [os.urandom(MiB) for _ in range(17)]
    sf, parts, whole = _spool(disk_dir, 4 * MiB, pieces, direct)
    try:
        assert len(parts) == 5
        reused = READ_BUFFERS.reused
        first = parts[0].read()
        assert isinstance(first, memoryview) and bytes(first) == whole[:4 * MiB]
        kept = first[:4096]  # a client still holds part of the body
        parts[0].done()
        second = parts[1].read()
        assert bytes(second) == whole[4 * MiB:8 * MiB]
        assert READ_BUFFERS.reused == reused  # part 1's buffer was still viewed
        assert bytes(kept) == whole[:4096]  # and was not overwritten
        del kept
        parts[1].done()
        third = parts[2].read()
        assert READ_BUFFERS.reused == reused + 1  # part 2's buffer, unviewed, came back
        assert bytes(third) == whole[8 * MiB:12 * MiB]
        parts[2].done()
        parts[2].done()  # twice is harmless
    finally:
        sf.discard()
    assert READ_BUFFERS.take(4 * MiB) is not None and READ_BUFFERS.reused == reused + 1


def test_tmpfs_falls_back_to_cached_writes() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    directory = Path("/dev/shm") / f"dcpv-test-{uuid.uuid4().hex[:8]}"
    sf, parts, whole = _spool(directory, 5 * MiB, [os.urandom(7 * MiB + 1)], True)
    try:
        if direct_supported(directory):
            pytest.skip("this tmpfs takes O_DIRECT")
        assert not sf.direct_io
        assert b"".join(bytes(p.read()) for p in parts) == whole
    finally:
        sf.discard()
        os.rmdir(directory)


def test_no_o_direct_on_the_platform_means_cached_writes(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(os, "O_DIRECT", 0, raising=False)
    sf, parts, whole = _spool(tmp_path, 5 * MiB, [os.urandom(6 * MiB)], True)
    try:
        assert not sf.direct_io
        assert b"".join(bytes(p.read()) for p in parts) == whole
    finally:
        sf.discard()


@pytest.mark.parametrize("sizes", [[3 * MiB], [77, 11 * MiB + 5, 5], [4096] * 3000])
def test_a_filesystem_refusing_direct_writes_falls_back(disk_dir: Path, sizes: list[int],
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Some filesystems take the O_DIRECT open and refuse the write (EINVAL): the file goes
    on through the page cache, every byte and part as the cached spool's."""
    refused: list[int] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        if fd == direct_fd[0] and sf.direct_io:  # fd numbers are reused
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    pieces = [os.urandom(n) for n in sizes]
    sf = SpoolFile("x", mode="disk", directory=str(disk_dir), part_size=5 * MiB, direct=True)
    direct_fd = [sf._disk._fd]  # type: ignore[union-attr]
    assert sf.direct_io
    monkeypatch.setattr(os, "write", write)
    try:
        sf.begin_item()
        for piece in pieces:
            sf.write(piece)
        sf.end_item()
        sf.close()
        parts = sf.parts.take()
        monkeypatch.setattr(os, "write", real_write)
        whole = b"".join(pieces)
        assert refused and not sf.direct_io
        assert b"".join(bytes(p.read()) for p in parts) == whole
        assert [p.part.crc for p in parts] == [crc32c.crc32c(bytes(p.read())) for p in parts]
        assert sf.path is not None
        with open(sf.path, "rb") as f:
            assert f.read() == whole
    finally:
        monkeypatch.setattr(os, "write", real_write)
        sf.discard()


def test_direct_io_must_be_a_bool_or_none() -> None:
    with pytest.raises(ConfigError, match="direct_io must be True, False or None"):
        SpoolOptions(direct_io="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("direct_io", [True, False, None])
def test_saves_load_bit_identical_from_local_files(disk_dir: Path, direct_io: bool | None
                                                   ) -> None:
    spool = SpoolOptions(directory=str(disk_dir / "spool"), direct_io=direct_io)
    spool_roundtrip(f"file://{disk_dir}/store/ck", {}, spool)
    assert os.listdir(disk_dir / "spool") == []  # every spool file was removed


@pytest.mark.parametrize("direct_io", [True, None])
def test_a_spool_kept_by_the_local_tier_is_whole(disk_dir: Path, direct_io: bool | None
                                                 ) -> None:
    """The tier keeps the spool files themselves: written directly or not, every byte."""
    spool = SpoolOptions(directory=str(disk_dir / "spool"), direct_io=direct_io)
    tier = LocalTierOptions(directory=str(disk_dir / "tier"))
    writer = spool_roundtrip(f"file://{disk_dir}/store/ck", {}, spool, tier)
    stats = writer.last_stats
    assert stats is not None and stats.bytes > 5 * MiB
    assert stats.bytes_kept_local == stats.bytes
    target = {"w": torch.zeros(1500, 1024), "b": torch.zeros(333),
              "h": torch.zeros(64, 64, dtype=torch.bfloat16), "step": 0}
    reader = VolumeReader(f"file://{disk_dir}/store/ck", local_tier=tier)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.last_stats is not None
    assert reader.last_stats.bytes_from_local == reader.last_stats.bytes_needed
    assert torch.equal(target["w"], spool_state()["w"])
