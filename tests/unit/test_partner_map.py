"""The partner map of partner replicas, the options that shape it, and a replica arriving in
a tier (its descriptor, retention)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp_volumes import LocalTierOptions, _layout, errors, tier
from dcp_volumes.tier._partners import partner_map
from dcp_volumes.tier._replicas import OwnCopy, TierReplica, own_copy


def test_derived_map_is_the_same_local_rank_on_the_next_node() -> None:
    assert partner_map(8, 2) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 6, 5: 7, 6: 0, 7: 1}
    assert partner_map(4, 2) == {0: 2, 1: 3, 2: 0, 3: 1}


@pytest.mark.parametrize("world, per_node", [(4, 4), (2, 8), (1, 1)],
                         ids=["one-full-node", "fewer-ranks-than-a-node", "single-rank"])
def test_one_node_has_no_partners(world: int, per_node: int) -> None:
    assert partner_map(world, per_node) == {}


def test_explicit_partners_override_the_derived_ones() -> None:
    assert partner_map(4, 2, {0: 3, 1: 2}) == {0: 3, 1: 2, 2: 0, 3: 1}


@pytest.mark.parametrize("world, per_node, partners, match", [
    (4, 2, {0: 1}, "same node"),
    (4, 2, {0: 4}, "ranks 0..3"),
    (3, 2, None, "not a multiple"),
], ids=["explicit-same-node", "out-of-range", "derived-same-node"])
def test_a_partner_on_the_same_node_or_outside_the_job_is_refused(
        world: int, per_node: int, partners: dict[int, int] | None, match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        partner_map(world, per_node, partners)


def test_options_validate_and_copy_the_partners() -> None:
    given = {0: 2, 2: 0}
    opts = LocalTierOptions(directory="/tmp/t", partner_replicas=True, ranks_per_node=2,
                            partners=given)
    given[0] = 1
    assert opts.partners == {0: 2, 2: 0}
    hash(opts)  # options stay hashable


@pytest.mark.parametrize("kwargs, match", [
    ({"partner_replicas": "yes"}, "True or False"),
    ({"partner_replicas": True, "ranks_per_node": 0}, "positive integer"),
    ({"partner_replicas": True, "partners": {0: 0}}, "to itself"),
    ({"partner_replicas": True, "partners": {0: -1}}, "integers >= 0"),
    ({"partner_replicas": True, "partners": [(0, 1)]}, "mapping"),
    ({"ranks_per_node": 2}, "partner_replicas=True"),
], ids=["not-bool", "zero-per-node", "self", "negative", "not-a-mapping", "without-opt-in"])
def test_bad_options_say_what_to_change(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        LocalTierOptions(directory="/tmp/t", **kwargs)  # type: ignore[arg-type]


def test_partners_on_the_same_node_are_refused_when_ranks_per_node_is_given() -> None:
    with pytest.raises(errors.ConfigError, match="same node"):
        LocalTierOptions(directory="/tmp/t", partner_replicas=True, ranks_per_node=4,
                         partners={0: 3})


# ---- a replica arriving in a tier (the receiving side, without a process group) -----------

def _receive(opts: LocalTierOptions, copy: OwnCopy, data: dict[str, bytes]) -> int:
    rep = TierReplica(opts, copy, me=1)
    for rel, _ in copy.files:
        rep.begin(rel)
        rep.write(memoryview(data[rel]))
        rep.end()
    return rep.complete(True)


def _copy_of(rank: int, save_key: str, size: int, url: str = "s3://b/r/step-1"
             ) -> tuple[OwnCopy, dict[str, bytes]]:
    rel = _layout.shard_name(rank, 0, save_key)
    return (OwnCopy(tier.normal_url(url), save_key, rank, ((rel, size),)),
            {rel: bytes(size)})


def test_a_replica_is_kept_marked_and_never_sent_on(tmp_path: Path) -> None:
    opts = LocalTierOptions(directory=str(tmp_path), keep_last=None)
    copy, data = _copy_of(0, "0000000a-000000000001", 10)
    assert _receive(opts, copy, data) == 10
    assert own_copy(opts, "s3://b/r/step-1", 0) is None  # a replica is not own
    (desc,) = tmp_path.glob("*/*/.dcpv-tier-0.json")
    assert json.loads(desc.read_text())["replica"] == {"held_by": 1}


def test_replicas_count_toward_the_tier_retention(tmp_path: Path) -> None:
    opts = LocalTierOptions(directory=str(tmp_path), keep_last=1)
    for i, key in enumerate(("0000000a-000000000001", "0000000b-000000000002")):
        copy, data = _copy_of(0, key, 10, url=f"s3://b/r/step-{i}")
        _receive(opts, copy, data)
    assert [p.parent.name for p in tmp_path.glob("*/*/.dcpv-tier-0.json")] == \
        ["0000000b-000000000002"]
    small = LocalTierOptions(directory=str(tmp_path / "small"), max_bytes=5)
    copy, data = _copy_of(0, "0000000c-000000000003", 10)
    assert _receive(small, copy, data) == 0  # larger than the whole budget: not kept
    assert not list((tmp_path / "small").rglob("*.distcp"))
