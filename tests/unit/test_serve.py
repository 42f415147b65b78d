"""The one serve path (``loading.serve``, moved from ``transfer.serve``): spans checked before
they are applied, failures returned typed for the next source, and one wording for missing
and truncated objects. Files are written with plain ``open`` behind the sources' backs."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
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
from dcp_volumes.loading.needs import Need, plan_ranges
from dcp_volumes.loading.serve import serve
from dcp_volumes.loading.sources import (
    CannotServe,
    LocalTierSource,
    Payload,
    StoreSource,
    Unserved,
    missing_object,
    truncated_object,
)
from dcp_volumes.tier import LocalFile
from dcp_volumes.transfer.download import RangeRequest, fanout_chunk

DATA = bytes(range(256)) * 16  # 4 KiB


def _read(fqn: str) -> ReadItem:
    none = torch.Size([])
    return ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), none, MetadataIndex(fqn), none,
                    none)


def _need(start: int, end: int, *, crc: int | None = None, rel: str = "a.distcp") -> Need:
    entry = ItemEntry(end - start, crc32c.crc32c(DATA[start:end]) if crc is None else crc)
    return Need.whole(rel, start, end - start, reads=[_read(f"item{start}")], entry=entry)


class _Collect:
    """A target that records what it is given."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, bytes]] = []

    def apply(self, span: Need, chunk: memoryview, into: Any) -> None:
        self.applied.append((span.start, bytes(chunk)))


class _Bytes:
    """A source serving DATA, or one typed answer for every range."""

    needs_check = True

    def __init__(self, answer: CannotServe | None = None) -> None:
        self.answer = answer

    def serve(self, ranges: Sequence[RangeRequest], stop: threading.Event | None = None
              ) -> Iterator[tuple[RangeRequest, Payload]]:
        for rng in ranges:
            yield rng, self.answer or DATA[rng.start:rng.end]


def test_spans_are_checked_before_they_are_applied() -> None:
    # was test_local_spans_are_checked_before_they_are_applied (serve_local's callbacks)
    good, bad = _need(0, 100), _need(100, 300, crc=1)
    ranges = plan_ranges([good, bad], gap=0, max_size=1 << 20)
    target = _Collect()
    served = serve(_Bytes(), ranges, target, url="file:///ckpt")
    assert target.applied == [(0, DATA[:100])]
    assert served.nbytes == 100 and served.failed == [bad]
    [(span, why)] = served.unserved
    assert span is bad and why.reason is Unserved.DAMAGED
    assert isinstance(why.error, errors.IntegrityError) and "checksum mismatch" in str(why.error)
    with pytest.raises(errors.IntegrityError, match="checksum mismatch"):
        serve(_Bytes(), ranges, _Collect(), url="file:///ckpt", last=True)


def test_a_range_not_served_leaves_all_its_spans_to_the_next_source() -> None:
    # was test_an_unreadable_local_range_leaves_all_its_spans_to_the_store
    needs = [_need(0, 100), _need(100, 200)]
    ranges = plan_ranges(needs, gap=0, max_size=1 << 20)
    target = _Collect()
    why = CannotServe(Unserved.UNREADABLE, "it cannot be read", errors.IntegrityError("x"))
    served = serve(_Bytes(why), ranges, target, url="u")
    assert not target.applied and served.nbytes == 0 and served.failed == needs
    assert [w for _, w in served.unserved] == [why, why]


def test_a_stopped_read_leaves_nothing() -> None:
    # was test_a_stopped_local_read_leaves_nothing
    stop = threading.Event()
    stop.set()
    target = _Collect()
    served = serve(_Bytes(), plan_ranges([_need(0, 10)], gap=0, max_size=100), target,
                   url="u", stop=stop)
    assert not target.applied and not served.failed and served.nbytes == 0


def _tier(tmp_path: Path, size: int = len(DATA)) -> LocalTierSource:
    path = tmp_path / "a.distcp"
    path.write_bytes(DATA)
    return LocalTierSource({"a.distcp": LocalFile(str(path), size)}, "file:///ckpt")


def test_local_tier_answers_each_failure_typed(tmp_path: Path) -> None:
    """What the local tier cannot serve is a typed answer, never text to parse (the reason
    a fallback warning names is ``CannotServe.why``)."""
    ranges = plan_ranges([_need(0, 100)], gap=0, max_size=1 << 20)
    source = _tier(tmp_path)
    [(_, got)] = list(source.serve(ranges))
    assert bytes(got) == DATA[:100]  # type: ignore[arg-type]
    other = plan_ranges([_need(0, 10, rel="b.distcp")], gap=0, max_size=100)
    [(_, got)] = list(source.serve(other))
    assert isinstance(got, CannotServe) and got.reason is Unserved.MISSING
    [(_, got)] = list(_tier(tmp_path, size=len(DATA) + 1).serve(ranges))  # changed size
    assert isinstance(got, CannotServe) and got.reason is Unserved.CHANGED
    assert "now 4096 bytes, expected 4097" in got.why
    link = tmp_path / "link.distcp"
    os.symlink(tmp_path / "a.distcp", link)
    linked = LocalTierSource({"a.distcp": LocalFile(str(link), len(DATA))}, "u")
    [(_, got)] = list(linked.serve(ranges))
    assert isinstance(got, CannotServe) and got.reason is Unserved.UNREADABLE
    past = [RangeRequest("a.distcp", len(DATA) - 10, len(DATA) + 10, [])]
    [(_, got)] = list(source.serve(past))
    assert isinstance(got, CannotServe) and got.reason is Unserved.CHANGED
    assert isinstance(got.error, errors.IntegrityError)


def test_local_tier_reads_straight_into_a_target(tmp_path: Path) -> None:
    """A range with ``into`` is read into that memory, on a few threads when several."""

    class _Into:  # a Memory: what a source may read a range into
        def __init__(self, n: int) -> None:
            self.view = torch.zeros(n, dtype=torch.uint8)

        def bytes_view(self) -> memoryview:
            return self.view.numpy().data.cast("B")

    source = _tier(tmp_path)
    ranges = [RangeRequest("a.distcp", a, a + 100, [], into=_Into(100)) for a in (0, 200, 400)]
    got = list(source.serve(ranges))
    assert [r.start for r, _ in got] == [0, 200, 400]
    for rng, payload in got:
        assert isinstance(rng.into, _Into)
        assert bytes(rng.into.view.numpy()) == DATA[rng.start:rng.end]
        assert bytes(payload) == DATA[rng.start:rng.end]  # type: ignore[arg-type]


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
    store = StoreSource(backend, "u", max_concurrency=2, chunk_size=256, stats=CallStats())
    store.check(ranges)
    target = _Collect()
    served = serve(store, ranges, target, url="u", last=True)
    assert served.nbytes == 1000 and store.fetched == 1000
    assert target.applied == [(0, DATA[:1000])]
    with pytest.raises(errors.IntegrityError, match="checksum mismatch"):
        serve(store, plan_ranges([bad], gap=0, max_size=4096), target, url="u", last=True)
    assert len(target.applied) == 1  # the corrupt span was never applied
    with pytest.raises(errors.IntegrityError, match="truncated or its metadata is damaged"):
        store.check([RangeRequest("a.distcp", 0, 5000, [_need(0, 5000)])])
    with pytest.raises(errors.IntegrityError, match="b.distcp of u is missing"):
        store.check([RangeRequest("b.distcp", 0, 10, [_need(0, 10, rel="b.distcp")])])


def test_an_object_deleted_while_fetching_is_a_typed_answer(tmp_path: Path) -> None:
    (tmp_path / "a.distcp").write_bytes(DATA)
    backend = open_backend(str(tmp_path), None)
    store = StoreSource(backend, "u", max_concurrency=1, chunk_size=4096, stats=CallStats())
    ranges = plan_ranges([_need(0, 100)], gap=0, max_size=4096)
    store.check(ranges)
    os.unlink(tmp_path / "a.distcp")
    [(_, got)] = list(store.serve(ranges))
    assert isinstance(got, CannotServe) and got.reason is Unserved.MISSING
    with pytest.raises(errors.IntegrityError, match="a.distcp of u is missing"):
        serve(store, ranges, _Collect(), url="u", last=True)


def test_a_few_parts_worth_is_spread_over_the_allowed_connections(tmp_path: Path) -> None:
    # 12 MiB in one range, 16 MiB GETs allowed, 6 at a time: 6 GETs of 2 MiB, not 1 of 12
    blob = bytes(range(256)) * (12 * 4096)
    (tmp_path / "big.distcp").write_bytes(blob)
    backend = open_backend(str(tmp_path), None)
    need = Need.whole("big.distcp", 0, len(blob))
    ranges = plan_ranges([need], gap=0, max_size=64 << 20)
    stats = CallStats()
    target = _Collect()
    store = StoreSource(backend, "u", max_concurrency=6, chunk_size=16 << 20, stats=stats)
    serve(store, ranges, target, url="u", last=True)
    assert [c for _, c in target.applied] == [blob] and stats.requests == 6
    assert fanout_chunk(12 << 20, 6, 16 << 20) == 2 << 20
    assert fanout_chunk(100 << 20, 4, 16 << 20) == 16 << 20  # never above chunk_size
    assert fanout_chunk(1 << 20, 16, 16 << 20) == 2 << 20  # never below MIN_SPLIT_GET
    assert fanout_chunk(1 << 20, 16, 1 << 20) == 1 << 20
