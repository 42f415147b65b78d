"""One object as a stream: written through the Uploader (``saving.objects``), read back
seekable and CRC-checked through the serve path (``loading.objects``). Against a local
directory (no server); the torch_checkpointing and export tests run them against S3."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from dcp_volumes import errors
from dcp_volumes._manifest import FileEntry
from dcp_volumes.backends import open_backend
from dcp_volumes.loading.objects import read_object
from dcp_volumes.saving.objects import write_object

PART = 256 << 10


@pytest.mark.parametrize("size", [0, 5, PART, 3 * PART + 7], ids=["empty", "small", "one-part",
                                                                  "several-parts"])
def test_an_object_written_as_a_stream_reads_back_checked(tmp_path: Path, size: int) -> None:
    backend = open_backend(str(tmp_path / "store"), None)
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    got: list[FileEntry] = []
    with write_object(backend, "a/b.bin", part_size=PART, max_concurrency=2,
                      done=got.append) as out:
        for i in range(0, size, 1000):
            out.write(data[i:i + 1000])
    (entry,) = got  # durable once closed: its entry (size, a CRC32C per part) handed over
    assert (tmp_path / "store" / "a" / "b.bin").read_bytes() == data
    assert entry.size == size and len(entry.items[0].block_crcs) == -(-size // PART)
    reader = read_object(backend, "a/b.bin", entry, max_concurrency=2, chunk_size=PART)
    assert reader.readall() == data
    reader.seek(-3, io.SEEK_END)
    assert reader.read(10) == data[-3:]
    reader.seek(PART - 2)
    assert reader.read(4) == data[PART - 2:PART + 2]


def test_a_stream_left_by_an_exception_leaves_nothing(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"), None)
    got: list[FileEntry] = []
    with pytest.raises(RuntimeError), write_object(backend, "x.bin", part_size=PART,
                                                   max_concurrency=2, done=got.append) as out:
        out.write(b"y" * (2 * PART + 1))
        raise RuntimeError("the serializer failed")
    assert not got and not (tmp_path / "store" / "x.bin").exists()


def test_a_changed_byte_fails_its_blocks_check(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"), None)
    got: list[FileEntry] = []
    with write_object(backend, "c.bin", part_size=PART, max_concurrency=2,
                      done=got.append) as out:
        out.write(b"z" * (2 * PART))
    path = tmp_path / "store" / "c.bin"
    flipped = bytearray(path.read_bytes())
    flipped[PART + 1] ^= 1
    path.write_bytes(bytes(flipped))
    reader = read_object(backend, "c.bin", got[0], max_concurrency=2, chunk_size=PART)
    assert reader.read(10) == b"z" * 10  # the first block is intact
    with pytest.raises(errors.IntegrityError, match="checksum"):
        reader.read(PART)
