"""The one serve path (``transfer.serve``): spans checked before they are applied, failures
left to the store, and one wording for missing and truncated objects. Files are written
with plain ``open`` behind the serve path's back."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_volumes import errors
from dcp_volumes._manifest import ItemEntry
from dcp_volumes.backends import CallStats, open_backend
from dcp_volumes.transfer.download import RangeRequest, fanout_chunk
from dcp_volumes.transfer.readplan import Need, plan_ranges
from dcp_volumes.transfer.serve import (
    check_store,
    missing_object,
    serve_local,
    serve_store,
    truncated_object,
)

DATA = bytes(range(256)) * 16  # 4 KiB


def _read(fqn: str) -> ReadItem:
    none = torch.Size([])
    return ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), none, MetadataIndex(fqn), none,
                    none)


def _need(start: int, end: int, *, crc: int | None = None, rel: str = "a.distcp") -> Need:
    entry = ItemEntry(end - start, crc32c.crc32c(DATA[start:end]) if crc is None else crc)
    return Need(rel, start, end, start, end - start, [_read(f"item{start}")], entry, None,
                end - start)


def _collect() -> tuple[list[Any], list[Any], dict[str, Any]]:
    applied: list[Any] = []
    failures: list[Any] = []

    def check(span: Need, chunk: memoryview) -> None:
        from dcp_volumes.transfer.readplan import check_need

        check_need(span, chunk, "file:///ckpt")

    hooks = {"check": check, "apply": lambda s, c: applied.append((s.start, bytes(c))),
             "unreadable": lambda rng, exc: failures.append(("unreadable", rng.start)),
             "bad": lambda span, exc: failures.append(("bad", span.start))}
    return applied, failures, hooks


def test_local_spans_are_checked_before_they_are_applied() -> None:
    good, bad = _need(0, 100), _need(100, 300, crc=1)
    ranges = plan_ranges([good, bad], gap=0, max_size=1 << 20)
    applied, failures, hooks = _collect()
    served = serve_local(ranges, lambda rng: DATA[rng.start:rng.end], **hooks)
    assert applied == [(0, DATA[:100])]
    assert served.nbytes == 100 and served.failed == [bad]
    assert failures == [("bad", 100)]


def test_an_unreadable_local_range_leaves_all_its_spans_to_the_store() -> None:
    needs = [_need(0, 100), _need(100, 200)]
    ranges = plan_ranges(needs, gap=0, max_size=1 << 20)
    applied, failures, hooks = _collect()

    def read(rng: RangeRequest) -> bytes:
        raise OSError(5, "it is shorter than expected")

    served = serve_local(ranges, read, **hooks)
    assert not applied and served.nbytes == 0 and served.failed == needs
    assert failures == [("unreadable", 0)]


def test_a_stopped_local_read_leaves_nothing() -> None:
    stop = threading.Event()
    stop.set()
    applied, _, hooks = _collect()
    served = serve_local(plan_ranges([_need(0, 10)], gap=0, max_size=100),
                         lambda rng: DATA[rng.start:rng.end], stop=stop, **hooks)
    assert not applied and not served.failed and served.nbytes == 0


def test_missing_and_truncated_name_the_item_when_there_is_one() -> None:
    need = _need(0, 100)
    with_item = RangeRequest("a.distcp", 0, 100, [need])
    assert "missing (needed for item 'item0')" in str(missing_object("u", with_item))
    text = str(truncated_object("u", with_item, 50))
    assert "truncated or its metadata is damaged: item 'item0' needs bytes up to 100" in text
    bare = RangeRequest("a.distcp", 0, 100, [RangeRequest("a.distcp", 0, 100)])
    assert "is missing: the checkpoint" in str(missing_object("u", bare))
    assert "bytes up to 100 are needed, the object has 50" in str(truncated_object("u", bare, 50))


def test_store_serve_checks_sizes_then_fetches_checks_and_applies(tmp_path: Path) -> None:
    (tmp_path / "a.distcp").write_bytes(DATA)
    backend = open_backend(str(tmp_path), None)
    good, bad = _need(0, 1000), _need(1000, 2000, crc=7)
    ranges = plan_ranges([good], gap=0, max_size=512)
    check_store(backend, ranges, "u")
    applied: list[Any] = []
    progress: list[tuple[int, int]] = []
    got = serve_store(backend, ranges, url="u", apply=lambda s, c: applied.append(bytes(c)),
                      max_concurrency=2, chunk_size=256, stats=CallStats(),
                      progress=lambda d, t: progress.append((d, t)))
    assert got == 1000 and applied == [DATA[:1000]] and progress[-1] == (1000, 1000)
    with pytest.raises(errors.IntegrityError, match="checksum mismatch"):
        serve_store(backend, plan_ranges([bad], gap=0, max_size=4096), url="u",
                    apply=lambda s, c: applied.append(bytes(c)), max_concurrency=1,
                    chunk_size=4096, stats=CallStats())
    assert len(applied) == 1  # the corrupt span was never applied
    with pytest.raises(errors.IntegrityError, match="truncated or its metadata is damaged"):
        check_store(backend, [RangeRequest("a.distcp", 0, 5000, [_need(0, 5000)])], "u")
    with pytest.raises(errors.IntegrityError, match="b.distcp of u is missing"):
        check_store(backend, [RangeRequest("b.distcp", 0, 10, [_need(0, 10, rel="b.distcp")])],
                    "u")


def test_a_few_parts_worth_is_spread_over_the_allowed_connections(tmp_path: Path) -> None:
    # 12 MiB in one range, 16 MiB GETs allowed, 6 at a time: 6 GETs of 2 MiB, not 1 of 12
    blob = bytes(range(256)) * (12 * 4096)
    (tmp_path / "big.distcp").write_bytes(blob)
    backend = open_backend(str(tmp_path), None)
    need = Need("big.distcp", 0, len(blob), 0, len(blob), [], None, None, len(blob))
    ranges = plan_ranges([need], gap=0, max_size=64 << 20)
    stats = CallStats()
    got: list[bytes] = []
    serve_store(backend, ranges, url="u", apply=lambda s, c: got.append(bytes(c)),
                max_concurrency=6, chunk_size=16 << 20, stats=stats)
    assert got == [blob] and stats.requests == 6
    assert fanout_chunk(12 << 20, 6, 16 << 20) == 2 << 20
    assert fanout_chunk(100 << 20, 4, 16 << 20) == 16 << 20  # never above chunk_size
    assert fanout_chunk(1 << 20, 16, 16 << 20) == 2 << 20  # never below MIN_SPLIT_GET
    assert fanout_chunk(1 << 20, 16, 1 << 20) == 1 << 20
