"""Repeated saves with ``DefaultSavePlanner(enable_plan_caching=True)`` and with ``no_dist``.

With plan caching, DCP sends a rank whose plan did not change an empty ``usable=False`` plan
and that rank reuses its first save's final plan, ``storage_data`` included. Every save must
still get its own objects (nothing shared with another save, never a shard overwritten in
place), commit last, load bit-identical, and carry a manifest that readers expect and verify.
Run on 2 gloo ranks and on one ``no_dist`` process, on local files and on SeaweedFS.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_volumes import VolumeReader, VolumeWriter, _commit_read, _layout
from dcp_volumes.backends import open_backend
from dcp_volumes.catalog import gc, list_checkpoints
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.suite import Store

SAVES = 3


def _state(step: int) -> dict[str, Any]:
    """Same structure every step (so the plans are cached), new values."""
    return {
        "a": torch.arange(2000, dtype=torch.float32) + step,
        "b": torch.full((3, 50), float(step), dtype=torch.bfloat16),
        "c": torch.arange(40, dtype=torch.int64) * (step + 1),
        "step": step,
        "meta": {"lr": 0.1 * (step + 1)},
    }


def _zeros() -> dict[str, Any]:
    s = _state(0)
    return {"a": torch.zeros_like(s["a"]), "b": torch.zeros_like(s["b"]),
            "c": torch.zeros_like(s["c"]), "step": -1, "meta": {"lr": 0.0}}


def saves_with_plan_caching(rank: int, world_size: int, root: str, options: dict[str, Any],
                            overwrite: bool, caching: bool, no_dist: bool) -> list[float]:
    """``SAVES`` saves in a loop (new path each step, or one path with overwrite=True);
    returns each save's wall time on this rank."""
    times = []
    for step in range(SAVES):
        url = f"{root}/one" if overwrite else f"{root}/step-{step}"
        writer = VolumeWriter(url, storage_options=options, overwrite=overwrite)
        planner = DefaultSavePlanner(enable_plan_caching=caching)
        start = time.perf_counter()
        dcp.save(_state(step), storage_writer=writer, planner=planner, no_dist=no_dist)
        times.append(time.perf_counter() - start)
        if not no_dist:
            torch.distributed.barrier()
    return times


def _load(url: str, options: dict[str, Any]) -> dict[str, Any]:
    state = _zeros()
    dcp.load(state, storage_reader=VolumeReader(url, storage_options=options), no_dist=True)
    return state


def _assert_loads(url: str, options: dict[str, Any], step: int) -> None:
    got, want = _load(url, options), _state(step)
    for k in ("a", "b", "c"):
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (url, k)
    assert got["step"] == step and got["meta"] == want["meta"]


def _committed(url: str, options: dict[str, Any]) -> tuple[str, set[str], list[str]]:
    """(save id, the objects the committed save consists of, every object in the directory)."""
    backend = open_backend(url, options)
    committed = _commit_read.read_committed(backend)
    assert committed.ours and committed.manifest is not None, "manifest not expected"
    assert committed.manifest.save_id == committed.save_id
    owned = _commit_read.objects_of(committed.metadata)
    assert set(committed.manifest.files) == owned - {_layout.manifest_name(committed.save_id)}
    names = backend.run(backend.list_names)
    return committed.save_id, owned, sorted(names)


@pytest.fixture(params=["local", "seaweedfs"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if request.param == "local":
        return Store(root=str(tmp_path / "root"))
    return request.getfixturevalue("seaweedfs").store()


@pytest.mark.parametrize("ranks", [2, "no_dist"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-path", "overwrite"])
def test_repeated_saves_with_plan_caching_each_get_their_own_objects(
        store: Store, ranks: Any, overwrite: bool) -> None:
    no_dist = ranks == "no_dist"
    root, options = store.root.rstrip("/"), store.storage_options
    if not overwrite:
        run_ranks(1 if no_dist else ranks, saves_with_plan_caching, root, options, False, True,
                  no_dist, timeout=300)
        seen: set[str] = set()
        ids = set()
        for step in range(SAVES):
            url = f"{root}/step-{step}"
            _assert_loads(url, options, step)
            save_id, owned, names = _committed(url, options)
            assert set(names) == owned | {_layout.METADATA}, names  # no live record left
            ids.add(save_id)
            shards = owned - {_layout.manifest_name(save_id)}
            assert not shards & seen, f"save {step} reuses the object names {shards & seen}"
            seen |= shards
            if ranks == 2 and step > 0:  # rank 1 reused its cached plan: it named its own id
                assert {_layout.save_id_of(s) for s in shards} - {save_id}, shards
        assert len(ids) == SAVES
        # gc finds nothing to collect and ls sees every save complete and loadable
        report = gc(root, storage_options=options, older_than_s=0.0, dry_run=True)
        assert not report.leftovers and not report.incomplete, report.as_dict()
        infos = list_checkpoints(root, storage_options=options, check=SAVES)
        assert [i.name for i in infos] == [f"step-{s}" for s in range(SAVES)]
        assert all(i.status == "complete" for i in infos), infos
        return
    # one path, overwrite=True: the plan cache lives in the process, so the checks after
    # each save run inside the ranks
    run_ranks(1 if no_dist else ranks, _overwrite_steps_checked, f"{root}/one", options,
              no_dist, timeout=300)


def _overwrite_steps_checked(rank: int, world_size: int, url: str, options: dict[str, Any],
                             no_dist: bool) -> None:
    """Overwrite one path ``SAVES`` times with plan caching, checking after each save (on
    rank 0) that the directory holds exactly that save's objects and loads bit-identical."""
    previous: set[str] = set()
    ids: set[str] = set()
    for step in range(SAVES):
        writer = VolumeWriter(url, storage_options=options, overwrite=True)
        dcp.save(_state(step), storage_writer=writer,
                 planner=DefaultSavePlanner(enable_plan_caching=True), no_dist=no_dist)
        if not no_dist:
            torch.distributed.barrier()
        if rank == 0:
            _assert_loads(url, options, step)
            save_id, owned, names = _committed(url, options)
            assert set(names) == owned | {_layout.METADATA}, (step, names)
            assert not owned & previous, f"save {step} shares {owned & previous} with the last"
            previous = owned
            ids.add(save_id)
        if not no_dist:
            torch.distributed.barrier()
    if rank == 0:
        assert len(ids) == SAVES
