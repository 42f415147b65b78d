"""One definition of a complete checkpoint (issue 25, finding 5).

A newest step whose ``.metadata`` is damaged (or whose manifest does not match) is not
complete anywhere: resume skips it, ``ls`` shows it unreadable, ``verify`` fails it, and a
new save of that step replaces it (before: ``CheckpointExistsError`` on every retry, so a
run that resumed from the step before could never save that step again).

On a local directory, moto, SeaweedFS, fake-gcs-server and Azurite (the session's servers,
tests/conftest.py): the replacement rides each store's conditional create. Damage
is done behind the store's back with raw fsspec calls.
"""

from __future__ import annotations

import collections
import json
import pickle
import threading
import uuid
import warnings
from typing import Any

import pytest
import torch
from _run_root import RunRoot
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import Checkpointer, VolumeWriter, _layout, catalog, errors
from dcp_volumes.testing.suite import failures_of

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Store(RunRoot):
    """A run root plus raw access to it (to damage objects behind the code's back)."""

    def put(self, rel: str, data: bytes) -> None:
        if self.local:
            self.fs.makedirs(self.fs._parent(self.path(rel)), exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def cat(self, rel: str) -> bytes:
        self.fs.invalidate_cache()
        return bytes(self.fs.cat_file(self.path(rel)))

    def manifest(self, rel: str) -> str:
        (name,) = [n for n in self.names(rel) if n.startswith(_layout.MANIFEST_PREFIX)]
        return name


def state_of(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64, 32), value) for i in range(2)}


@pytest.fixture(params=["local", "moto", "seaweedfs", "fake_gcs", "azurite"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "run"), {})
    server = request.getfixturevalue(request.param)
    return Store(f"{server.root}/{uuid.uuid4().hex[:12]}", server.server.storage_options())


def _garbage_metadata(store: Store, rel: str) -> None:
    store.put(f"{rel}/.metadata", b"\x00 this is not a pickle \xff" * 4)


def _unsafe_metadata(store: Store, rel: str) -> None:
    store.put(f"{rel}/.metadata", pickle.dumps(collections.Counter(a=1)))


def _manifest_missing(store: Store, rel: str) -> None:
    store.fs.rm_file(store.path(f"{rel}/{store.manifest(rel)}"))


def _manifest_of_another_save(store: Store, rel: str) -> None:
    name = store.manifest(rel)
    doc = json.loads(store.cat(f"{rel}/{name}"))
    doc["save_id"] = "6a000000-0123456789ab"
    store.put(f"{rel}/{name}", json.dumps(doc).encode())


DAMAGES = {
    "garbage-metadata": _garbage_metadata,
    "unsafe-metadata": _unsafe_metadata,
    "manifest-missing": _manifest_missing,
    "manifest-of-another-save": _manifest_of_another_save,
}


def statuses(store: Store) -> dict[str, str]:
    return {i.name: i.status
            for i in catalog.list_checkpoints(store.root, storage_options=store.options)}


def verifies(store: Store, rel: str) -> bool:
    try:
        return catalog.verify(store.url(rel), storage_options=store.options).ok
    except errors.DCPVolumesError:
        return False


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_a_save_over_a_damaged_newest_step_replaces_it(store: Store, damage: str) -> None:
    store.save("step-1", 1.0)
    store.save("step-2", 2.0)
    DAMAGES[damage](store, "step-2")
    assert statuses(store) == {"step-1": "complete", "step-2": "unreadable"}
    assert not verifies(store, "step-2")  # verify agrees with ls

    # the resume: latest skips it and loads the step before
    info = catalog.latest(store.root, storage_options=store.options)
    assert info is not None and info.name == "step-1"
    # the next save of that step replaces it (no overwrite=True needed: it was not complete)
    store.save("step-2", 3.0)

    assert statuses(store) == {"step-1": "complete", "step-2": "complete"}
    info = catalog.latest(store.root, storage_options=store.options)
    assert info is not None and info.name == "step-2"
    assert store.load("step-2") == 3.0
    assert verifies(store, "step-2")
    assert not [n for n in store.names("step-2") if ".replacing-" in n]  # the claim is gone


def test_a_complete_step_is_still_refused(store: Store) -> None:
    store.save("step-1", 1.0)
    with pytest.raises(CheckpointException) as info:
        store.save("step-1", 2.0)
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.CheckpointExistsError)
    assert store.load("step-1") == 1.0


def test_the_checkpointer_resumes_past_a_damaged_step_and_saves_it_again(store: Store) -> None:
    ckpt = Checkpointer(store.root, storage_options=store.options, every_steps=1)
    for step in (1, 2):
        ckpt.save(step, state_of(float(step)))
    ckpt.close()
    _garbage_metadata(store, ckpt.url_for(2).rsplit("/", 1)[1])

    again = Checkpointer(store.root, storage_options=store.options, every_steps=1)
    state = state_of(0.0)
    assert again.load_latest(state) == 1 and float(state["t0"][0, 0]) == 1.0
    assert again.save(2, state_of(5.0))  # was CheckpointExistsError on every retry
    again.close()
    third = Checkpointer(store.root, storage_options=store.options, every_steps=1)
    assert third.load_latest(state) == 2 and float(state["t0"][0, 0]) == 5.0
    third.close()


class _PausedWriter(VolumeWriter):
    """Plans (and sees the damaged .metadata), then waits before its commit."""

    planned = threading.Event()
    go = threading.Event()

    def finish(self, metadata: Any, results: Any) -> None:
        type(self).planned.set()
        assert type(self).go.wait(60)
        super().finish(metadata, results)


def test_of_two_saves_replacing_one_damaged_step_exactly_one_commits(store: Store) -> None:
    store.save("step-1", 1.0)
    _garbage_metadata(store, "step-1")
    before = set(store.names("step-1"))  # the damaged save's objects: left for gc
    paused = type("W", (_PausedWriter,), {"planned": threading.Event(), "go": threading.Event()})
    failed: list[BaseException] = []

    def slow() -> None:
        try:
            store.save("step-1", 2.0, writer=paused)
        except CheckpointException as exc:
            failed.extend(failures_of(exc))

    thread = threading.Thread(target=slow)
    thread.start()
    try:
        assert paused.planned.wait(60)
        store.save("step-1", 3.0)  # replaces the damaged .metadata first
    finally:
        paused.go.set()
        thread.join(60)

    (err,) = failed
    assert isinstance(err, errors.CheckpointExistsError) and "replaced" in str(err)
    assert store.load("step-1") == 3.0  # entirely the winner's save
    assert statuses(store) == {"step-1": "complete"}
    new = set(store.names("step-1")) - before  # the loser's shards were removed
    winner = pickle.loads(store.cat("step-1/.metadata")).storage_meta.save_id
    assert {_layout.save_id_of(n) for n in new} - {None} == {winner}, new


def test_a_save_refuses_to_replace_while_another_holds_the_claim(store: Store) -> None:
    store.save("step-1", 1.0)
    _garbage_metadata(store, "step-1")
    from dcp_volumes._commit_read import metadata_version

    claim = f".metadata.replacing-{metadata_version(store.cat('step-1/.metadata'))[:32]}.tmp"
    store.put(f"step-1/{claim}", b"another save")
    with pytest.raises(CheckpointException) as info:
        store.save("step-1", 2.0)
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.CheckpointExistsError) and "being replaced" in str(err)
    assert statuses(store) == {"step-1": "unreadable"}  # the damaged one is left as it was
    assert store.cat(f"step-1/{claim}") == b"another save"
