"""The save as a stream: a spool file's parts go from the thread that serializes it to the
uploader's event loop through a :class:`PartStream`; a failed upload cancels the stream and
the spool stops at its next part. Against a local directory (no server)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import crc32c
import pytest

from dcp_volumes import errors
from dcp_volumes.backends import CallStats, open_backend
from dcp_volumes.backends.sink import Part
from dcp_volumes.saving import PartStream, SpooledPart, SpoolFile, Uploader

MiB = 1 << 20


def _part(number: int, released: list[int] | None = None) -> SpooledPart:
    sp = SpooledPart(Part(number, (number - 1) * 4, 4, False, 0), buffer=bytearray(b"abcd"))
    if released is not None:
        sp.release = lambda: released.append(number)
    return sp


def test_parts_put_by_a_thread_come_out_on_the_loop_in_order() -> None:
    stream = PartStream()

    def produce() -> None:
        for n in range(1, 201):
            stream.put(_part(n))
        stream.end()

    async def consume() -> list[int]:
        producer = threading.Thread(target=produce)
        producer.start()
        numbers = [sp.part.number async for sp in stream]
        producer.join()
        return numbers

    assert asyncio.run(consume()) == list(range(1, 201))


def test_a_cancelled_stream_stops_the_producer_and_frees_what_waits() -> None:
    stream = PartStream()
    released: list[int] = []
    stream.put(_part(1, released))
    stream.put(_part(2, released))
    failure = errors.UploadError("part 7 failed for good")
    stream.cancel(failure)
    assert released == [1, 2]  # the buffers of parts nobody will upload are freed
    with pytest.raises(errors.UploadError) as info:
        stream.put(_part(3, released))
    assert info.value is failure
    with pytest.raises(errors.UploadError):
        stream.check()

    async def consume() -> list[SpooledPart]:
        return [sp async for sp in stream]

    assert asyncio.run(consume()) == []  # the consumer stops too


@pytest.mark.parametrize("mode", ["disk", "memory"])
def test_the_uploader_takes_a_spool_files_parts_from_its_stream(tmp_path: Path,
                                                                 mode: str) -> None:
    backend = open_backend(str(tmp_path / "store"), None)
    uploader = Uploader(backend, part_size=5 * MiB, max_concurrency=2, stats=CallStats(),
                        adaptive=False)
    slots = threading.Semaphore(3) if mode == "memory" else None
    data = os.urandom(17 * MiB + 3)
    sf = SpoolFile("shard.distcp", mode=mode, directory=str(tmp_path / "spool"),
                   part_size=5 * MiB, buffer_slots=slots)
    try:
        uploader.upload("shard.distcp", sf.parts, expected_size=len(data))
        for i in range(0, len(data), 3 * MiB):  # the file uploads while it is written
            sf.write(data[i:i + 3 * MiB])
        assert sf.close() == len(data)
        uploader.wait()
    finally:
        sf.discard()
    assert (tmp_path / "store" / "shard.distcp").read_bytes() == data
    assert sf.parts_handed_out == 4 and uploader.bytes_uploaded == len(data)
    if slots is not None:  # every part buffer went back
        assert all(slots.acquire(blocking=False) for _ in range(3))
    assert crc32c.crc32c(data) == crc32c.crc32c((tmp_path / "store" / "shard.distcp")
                                                .read_bytes())


def test_a_failed_upload_stops_the_spool_at_its_next_part(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"), None)
    uploader = Uploader(backend, part_size=5 * MiB, max_concurrency=2, stats=CallStats(),
                        adaptive=False)
    slots = threading.Semaphore(3)
    sf = SpoolFile("shard.distcp", mode="memory", directory="", part_size=5 * MiB,
                   buffer_slots=slots)
    failure = errors.UploadError("the store refused part 1 for good")
    try:
        upload = uploader.upload("shard.distcp", sf.parts, expected_size=40 * MiB)

        async def refuse(part: Part, data: bytes | bytearray) -> None:
            raise failure

        upload.sink.put_part = refuse  # type: ignore[method-assign]
        with pytest.raises(errors.UploadError) as info:
            for _ in range(40):  # 8 parts; the upload of part 1 fails
                sf.write(os.urandom(MiB))
        assert info.value is failure
        uploader.abort()
    finally:
        sf.discard()
    with pytest.raises(errors.UploadError):
        uploader.raise_if_failed()
    assert not (tmp_path / "store" / "shard.distcp").exists()
    assert all(slots.acquire(blocking=False) for _ in range(3))  # no buffer left behind
