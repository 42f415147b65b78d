"""Issue 18: what a tier reads from disk or from a partner is untrusted. Descriptors with
malformed numbers make their save unusable and nothing else; a partner's copy must be its
own (its rank, shard names only) and is sized from the files, not from a descriptor; a
sender whose read fails ends its stream. No process group: the pieces directly."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from dcp_volumes import LocalTierOptions, _layout
from dcp_volumes.tier import Descriptor, DurableBase, TierSave, normal_url, walk_saves
from dcp_volumes.tier._descriptor import LocalOnlyRef
from dcp_volumes.tier._layout import url_key
from dcp_volumes.tier._local_only import continues
from dcp_volumes.tier._partners import _OwnReader
from dcp_volumes.tier._replicas import OwnCopy, TierReplica, own_copy
from dcp_volumes.tier._retention import apply_retention

URL = "s3://b/run/step-00000100"
KEY = "0000000a-000000000001"
SID = "0000000b-000000000002"
SHA = "ab" * 32


def _doc(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {"format": 1, "url": normal_url(URL), "save_key": KEY, "rank": 0,
                              "created": 1.7e9, "files": {_layout.shard_name(0, 0, KEY): 10}}
    doc.update(over)
    return doc


def _parse(doc: dict[str, object] | str) -> Descriptor | None:
    raw = doc if isinstance(doc, str) else json.dumps(doc)
    return Descriptor.parse(raw.encode(), save_key=KEY)


def test_a_well_formed_descriptor_round_trips() -> None:
    base = DurableBase(normal_url("s3://b/run/step-00000050"), SID, SHA)
    d = Descriptor(normal_url(URL), KEY, 3, 1.7e9, {_layout.shard_name(3, 0, KEY): 10},
                   LocalOnlyRef(SID, 4, SHA, base), held_by=1)
    assert Descriptor.parse(d.to_json(), save_key=KEY) == d


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(_doc()).replace('"created": 1700000000.0', '"created": ' + "9" * 400),
        json.dumps(_doc()).replace('"created": 1700000000.0', '"created": 1e400'),
        json.dumps(_doc()).replace('"rank": 0', '"rank": ' + "9" * 400),
        json.dumps(_doc(created=-1)),
        json.dumps(_doc(created=float("nan"))),
        json.dumps(_doc(files={_layout.shard_name(0, 0, KEY): 10 ** 400})),
        json.dumps(_doc(files={_layout.shard_name(0, 0, KEY): -1})),
        json.dumps(_doc(files={".dcpv-tier-1.json": 10})),
        json.dumps(_doc(local_only={"save_id": SID, "world": 10 ** 400,
                                    "manifest_sha256": SHA})),
        json.dumps(_doc(local_only={"save_id": SID, "world": 1, "manifest_sha256": SHA,
                                    "base": {"url": 1, "save_id": SID,
                                             "manifest_sha256": SHA}})),
        json.dumps(_doc(replica={"held_by": 1e400})),
        "[" * 100_000,
    ],
    ids=["created-10e400", "created-1e400", "rank-10e400", "created-negative", "created-nan",
         "size-10e400", "size-negative", "descriptor-as-file", "world-10e400", "bad-base",
         "held-by-1e400", "deep-nesting"],
)
def test_malformed_numbers_make_the_descriptor_unusable(raw: str) -> None:
    assert Descriptor.parse(raw.encode(), save_key=KEY) is None


def test_a_bad_descriptor_spoils_its_save_and_nothing_else(tmp_path: Path) -> None:
    opts = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=None)
    for key in (KEY, SID):
        src = tmp_path / f"spool-{key}"
        src.write_bytes(b"x" * 10)
        save = TierSave(opts, URL, key, 0)
        save.keep(str(src), _layout.shard_name(0, 0, key), 10)
        save.complete()
    bad = tmp_path / "tier" / url_key(URL) / KEY / ".dcpv-tier-0.json"
    bad.write_text(re.sub(r'"created": [0-9.e+]+', '"created": 1' + "0" * 400,
                          bad.read_text()))
    assert _parse(bad.read_text()) is None
    found = {s.save_key: s.descriptors() for s in walk_saves(opts.resolved_directory())}
    assert found[KEY] == [] and len(found[SID]) == 1
    assert apply_retention(opts) == []  # fresh: the unusable save is not stale yet


def test_lineage_is_exact() -> None:
    base = DurableBase("s3://b/run/step-1", SID, SHA)
    assert continues(base, base)
    assert not continues(base, DurableBase("s3://b/run/step-1", KEY, SHA))  # replaced
    assert not continues(base, None)  # removed: the store has no durable checkpoint
    assert not continues(None, base)  # followed no durable save, and the store has one
    assert continues(None, None)


# ---- partners -------------------------------------------------------------------------

def _offer(rank: int, *files: tuple[str, int]) -> OwnCopy:
    return OwnCopy(normal_url(URL), KEY, rank, files)


@pytest.mark.parametrize(
    ("copy", "sender"),
    [
        (_offer(1, (_layout.shard_name(1, 0, KEY), 10)), 0),
        (_offer(0, (".dcpv-tier-1.json", 10)), 0),
        (_offer(0, ("x/.dcpv-tier-0.json", 10)), 0),
        (_offer(0, ("../escape.distcp", 10)), 0),
        (_offer(0, (_layout.shard_name(0, 0, KEY), 10 ** 400)), 0),
        (_offer(0, (_layout.shard_name(0, 0, KEY), -5)), 0),
        (OwnCopy(normal_url(URL), "../../x", 0, ()), 0),
    ],
    ids=["another-ranks-copy", "descriptor-name", "nested-descriptor-name", "escape",
         "huge-size", "negative-size", "bad-save-key"],
)
def test_a_partner_offer_that_is_not_its_own_copy_is_refused(
        tmp_path: Path, copy: OwnCopy, sender: int) -> None:
    opts = LocalTierOptions(directory=str(tmp_path), keep_last=None)
    mine = tmp_path / url_key(URL) / KEY / ".dcpv-tier-1.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("{}")
    rep = TierReplica(opts, copy, me=1, sender=sender)
    assert not rep.ok
    for relative, _ in copy.files:
        rep.begin(relative)
        rep.write(memoryview(b"evil"))
        rep.end()
    assert rep.complete(True) == 0
    assert mine.read_text() == "{}"  # the receiver's own descriptor is untouched
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [mine.name]


def test_a_copy_larger_than_the_free_disk_is_refused(tmp_path: Path) -> None:
    opts = LocalTierOptions(directory=str(tmp_path), keep_last=None)
    rep = TierReplica(opts, _offer(0, (_layout.shard_name(0, 0, KEY), (1 << 50) - 1)), me=1,
                      sender=0)
    assert not rep.ok


def _kept(tmp_path: Path, data: bytes) -> tuple[LocalTierOptions, str]:
    """Rank 0's one shard file of ``data`` kept in a tier under ``tmp_path``."""
    opts = LocalTierOptions(directory=str(tmp_path / "tier"), keep_last=None)
    rel = _layout.shard_name(0, 0, KEY)
    src = tmp_path / "spool"
    src.write_bytes(data)
    save = TierSave(opts, URL, KEY, 0)
    save.keep(str(src), rel, len(data))
    save.complete()
    return opts, rel


def test_own_copy_is_sized_from_the_files(tmp_path: Path) -> None:
    opts, rel = _kept(tmp_path, b"x" * 10)
    desc = tmp_path / "tier" / url_key(URL) / KEY / ".dcpv-tier-0.json"
    desc.write_text(desc.read_text().replace('": 10}', f'": {1 << 40}}}'))  # claims 1 TiB
    copy = own_copy(opts, URL, 0)
    assert copy is not None and copy.files == ((rel, 10),)
    os.unlink(tmp_path / "tier" / url_key(URL) / KEY / rel)
    assert own_copy(opts, URL, 0) is None  # a file gone: nothing to offer


def test_a_failed_read_ends_the_senders_stream(tmp_path: Path) -> None:
    opts, rel = _kept(tmp_path, b"y" * 100)
    copy = own_copy(opts, URL, 0)
    assert copy is not None
    reader = _OwnReader(opts, 0, copy)
    first = reader.chunk(0, 0, 50)
    assert first[-1] == 1 and bytes(first[:50]) == b"y" * 50 and reader.ok
    os.truncate(tmp_path / "tier" / url_key(URL) / KEY / rel, 60)  # shrank meanwhile
    second = reader.chunk(0, 50, 50)
    reader.close()
    assert second[-1] == 0 and not reader.ok  # the status byte ends the stream
