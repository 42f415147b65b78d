"""Lifecycle tools that cannot destroy data (issue 10, findings 6 and 7).

- "Complete" means loadable: ``latest``, retention and ``ls`` read ``.metadata`` and the
  manifest; a checkpoint that does not load never counts, and retention never removes the
  newest one that loads.
- gc judges a save's objects as a group and leaves a running save alone (its live record).
- The writer checks, just before its commit, that every object it wrote is there at its
  size, and never commits otherwise.

On a local directory and a moto S3 server (the session's, from tests/conftest.py). Objects are
damaged "behind the store's back" with raw fsspec calls, so the code under test never checks
itself.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
import warnings
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import (
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    VolumeWriter,
    _complete,
    _layout,
    catalog,
    errors,
)
from dcp_volumes._compat import no_dist
from dcp_volumes.testing.suite import SlowPlanner, failures_of

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

OLD_SAVE_ID = "6a000000-0123456789ab"  # an old save id (2026-05) that no real save will reuse


# --------------------------------------------------------------------------------------------
# fixtures and helpers


class Store:
    """A run root plus raw access to it (for writing and damaging objects behind our back)."""

    def __init__(self, root: str, options: dict[str, Any]) -> None:
        self.root = root
        self.options = options
        self.s3 = root.startswith("s3://")
        if self.s3:
            self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        else:
            self.fs = fsspec.filesystem("file")

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}".removeprefix("s3://")

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def writer(self, rel: str, **kwargs: Any) -> VolumeWriter:
        return VolumeWriter(self.url(rel), storage_options=self.options, **kwargs)

    def save(self, rel: str, value: float = 1.0, **writer_kwargs: Any) -> None:
        dcp.save(state_of(value), storage_writer=self.writer(rel, **writer_kwargs), **no_dist())

    def load(self, rel: str) -> float:
        """The value the checkpoint holds (every tensor is filled with it)."""
        state = state_of(0.0)
        dcp.load(
            state,
            storage_reader=VolumeReader(self.url(rel), storage_options=self.options),
            **no_dist(),
        )
        values = {float(t.flatten()[0]) for t in state.values()}
        assert len(values) == 1 and all(bool((t == t.flatten()[0]).all()) for t in state.values())
        return values.pop()

    def put(self, rel: str, data: bytes) -> None:
        if not self.s3:
            self.fs.makedirs(self.fs._parent(self.path(rel)), exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def cat(self, rel: str) -> bytes:
        self.fs.invalidate_cache()  # s3fs sizes objects from its listing cache
        return bytes(self.fs.cat_file(self.path(rel)))

    def rm(self, rel: str) -> None:
        self.fs.invalidate_cache()
        self.fs.rm_file(self.path(rel))

    def names(self, rel: str = "") -> list[str]:
        self.fs.invalidate_cache()
        base = self.path(rel).rstrip("/") + "/"
        return sorted(p[len(base) :] for p in self.fs.find(base.rstrip("/")))

    def manifest(self, rel: str) -> str:
        (name,) = [n for n in self.names(rel) if n.startswith(_layout.MANIFEST_PREFIX)]
        return name


def state_of(value: float, n: int = 2) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64, 32), value) for i in range(n)}


@pytest.fixture(params=["local", "moto"], ids=["local", "moto"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "run"), {})
    return _s3_store(request.getfixturevalue("moto"))


def _s3_store(moto: Any) -> Store:
    """A fresh root in the session's moto bucket."""
    return Store(f"{moto.root}/{uuid.uuid4().hex[:12]}", moto.server.storage_options())


@pytest.fixture
def local(tmp_path: Any) -> Store:
    return Store(str(tmp_path / "run"), {})


def _garbage_metadata(store: Store, rel: str) -> None:
    store.put(f"{rel}/.metadata", b"\x00 this is not a pickle \xff" * 4)


def _unsafe_metadata(store: Store, rel: str) -> None:
    store.put(f"{rel}/.metadata", pickle.dumps(collections.Counter(a=1)))


def _manifest_missing(store: Store, rel: str) -> None:
    store.rm(f"{rel}/{store.manifest(rel)}")


def _manifest_of_another_save(store: Store, rel: str) -> None:
    name = store.manifest(rel)
    doc = json.loads(store.cat(f"{rel}/{name}"))
    doc["save_id"] = OLD_SAVE_ID
    store.put(f"{rel}/{name}", json.dumps(doc).encode())


DAMAGES = {
    "garbage-metadata": _garbage_metadata,
    "unsafe-metadata": _unsafe_metadata,
    "manifest-missing": _manifest_missing,
    "manifest-of-another-save": _manifest_of_another_save,
}


def statuses(store: Store, **kwargs: Any) -> dict[str, str]:
    infos = catalog.list_checkpoints(store.root, storage_options=store.options, **kwargs)
    return {i.name: i.status for i in infos}


# --------------------------------------------------------------------------------------------
# 1. "complete" means loadable: retention, latest, ls


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_retention_keeps_the_newest_loadable_checkpoint(store: Store, damage: str) -> None:
    store.save("step-1", 1.0)
    store.save("step-2", 2.0)
    DAMAGES[damage](store, "step-2")

    removed = catalog.apply_retention(store.root, keep_last=1, storage_options=store.options)

    assert removed == []  # step-1 is the only checkpoint that loads: it stays
    assert store.load("step-1") == 1.0
    assert store.names("step-2")  # what does not load is left for a person to look at
    assert statuses(store) == {"step-1": "complete", "step-2": "unreadable"}


def test_checkpoints_that_do_not_load_never_count_toward_keep_last(store: Store) -> None:
    for step in range(1, 6):
        store.save(f"step-{step}", float(step))
    _garbage_metadata(store, "step-5")
    _manifest_missing(store, "step-3")

    removed = catalog.apply_retention(store.root, keep_last=2, storage_options=store.options)

    # newest first: 5 (no), 4 (yes), 3 (no), 2 (yes) -> the window of two ends at step-2
    assert removed == [store.url("step-1")]
    assert [store.load(f"step-{s}") for s in (2, 4)] == [2.0, 4.0]
    assert statuses(store) == {
        "step-2": "complete",
        "step-3": "unreadable",
        "step-4": "complete",
        "step-5": "unreadable",
    }


def test_retention_removes_nothing_when_nothing_loads(local: Store) -> None:
    for step in (1, 2, 3):
        local.save(f"step-{step}")
        _garbage_metadata(local, f"step-{step}")
    assert catalog.apply_retention(local.root, keep_last=1) == []
    assert catalog.latest(local.root) is None


@pytest.mark.parametrize(
    "damage", ["garbage-metadata", "manifest-missing"], ids=["garbage-metadata", "manifest-missing"]
)
def test_latest_skips_checkpoints_that_do_not_load(store: Store, damage: str) -> None:
    for step in (1, 2, 3):
        store.save(f"step-{step}", float(step))
    DAMAGES[damage](store, "step-3")

    info = catalog.latest(store.root, storage_options=store.options)

    assert info is not None and info.name == "step-2" and info.status == "complete"
    assert store.load(info.name) == 2.0


def test_ls_shows_unreadable_checkpoints_and_reads_only_the_newest(
    local: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in range(1, 7):
        local.save(f"step-{step}", float(step))
    _garbage_metadata(local, "step-6")
    local.put(f"step-7/__0_0-{OLD_SAVE_ID}.distcp", b"killed")
    reads: list[str] = []
    # every read of a checkpoint goes through the one definition of complete
    completeness = _complete.completeness

    def spy(backend: Any, **kwargs: Any) -> Any:
        reads.append(backend.url.rsplit("/", 1)[-1])
        return completeness(backend, **kwargs)

    monkeypatch.setattr(_complete, "completeness", spy)

    infos = catalog.list_checkpoints(local.root)  # default: the newest 16 are read
    assert [(i.name, i.status, i.complete) for i in infos] == [
        *[(f"step-{s}", "complete", True) for s in range(1, 6)],
        ("step-6", "unreadable", False),
        ("step-7", "incomplete", False),
    ]
    assert "IntegrityError" in (infos[5].problem or "") and infos[5].as_dict()["status"] == (
        "unreadable"
    )

    reads.clear()
    cheap = catalog.list_checkpoints(local.root, check=1)  # the newest, and on until one loads
    assert sorted(reads) == ["step-5", "step-6"]
    assert [i.status for i in cheap] == ["committed"] * 4 + ["complete", "unreadable", "incomplete"]
    newest_complete = max((i for i in cheap if i.complete), key=lambda i: i.step or 0)
    assert newest_complete.name == "step-5" and newest_complete.checked

    reads.clear()
    listing_only = catalog.list_checkpoints(local.root, check=0)
    assert reads == [] and [i.status for i in listing_only] == ["committed"] * 6 + ["incomplete"]

    reads.clear()
    assert catalog.latest(local.root).name == "step-5"  # type: ignore[union-attr]
    assert sorted(reads) == ["step-5", "step-6"]

    with pytest.raises(errors.ConfigError, match="check"):
        catalog.list_checkpoints(local.root, check=-1)


# --------------------------------------------------------------------------------------------
# 2. gc never removes an object of a save that may still be running


def _gc_while(store: Store, save: threading.Thread, **kwargs: Any) -> list[catalog.GcReport]:
    """Collect (for real, threshold 0) again and again while ``save`` runs."""
    reports = []
    while save.is_alive():
        reports.append(
            catalog.gc(
                store.root, older_than_s=0, storage_options=store.options, dry_run=False, **kwargs
            )
        )
        time.sleep(0.05)
    save.join()
    return reports


def _slow_save(
    store: Store, rel: str, value: float, box: dict[str, Any], **writer_kwargs: Any
) -> threading.Thread:
    """A save of 8 items in 4 files, 0.4 s per item: its first shards are in the store long
    before it commits."""

    def run() -> None:
        try:
            dcp.save(
                state_of(value, n=8),
                storage_writer=store.writer(
                    rel,
                    spool=SpoolOptions(files_per_rank=4),
                    transfer=TransferOptions(max_concurrency=2),
                    **writer_kwargs,
                ),
                planner=SlowPlanner(0.4),
                **no_dist(),
            )
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "new-path"])
def test_gc_during_a_running_save_removes_nothing_of_it(store: Store, overwrite: bool) -> None:
    store.save("step-1", 1.0)
    box: dict[str, Any] = {}
    rel = "step-1" if overwrite else "step-2"
    save = _slow_save(store, rel, 2.0, box, overwrite=overwrite)

    reports = _gc_while(store, save)

    assert "error" not in box, box.get("error")
    assert len(reports) >= 3, "gc never ran while the save was running"
    new_id = _layout.save_id_of(store.manifest(rel))
    assert new_id is not None
    collected = [u for r in reports for u in (*r.leftovers, *r.incomplete)]
    # (the old save's objects may be collected in the instant between the commit and the
    # writer's own removal of them: they are superseded by then)
    assert [u for u in collected if new_id in u or u == store.url(rel)] == []
    assert any(new_id in s and "may be running" in s for r in reports for s in r.skipped)
    assert store.load(rel) == 2.0
    assert store.load("step-1") == (2.0 if overwrite else 1.0)
    # the live record went with the commit, and so did (with overwrite) the old save
    assert [n for n in store.names(rel) if n.startswith(_layout.LIVE_PREFIX)] == []
    if overwrite:
        assert len({_layout.save_id_of(n) for n in store.names(rel)} - {None}) == 1


def test_gc_judges_a_save_by_its_newest_object(local: Store) -> None:
    """Without a live record (a writer that predates it), the newest object of a save
    protects all of its objects, not only itself."""
    local.save("step-1")
    old = time.time() - 3600
    for name in (f"__0_0-{OLD_SAVE_ID}.distcp", f"__1_0-{OLD_SAVE_ID}.distcp"):
        local.put(f"step-1/{name}", b"x" * 10)
        os.utime(local.path(f"step-1/{name}"), (old, old))
    local.put(f"step-1/__2_0-{OLD_SAVE_ID}.distcp", b"just written")  # the same save, now

    report = catalog.gc(local.root, older_than_s=60, dry_run=False)

    assert report.leftovers == [] and any(OLD_SAVE_ID in s for s in report.skipped)
    assert len([n for n in local.names("step-1") if OLD_SAVE_ID in n]) == 3


def test_gc_collects_a_killed_save_once_its_live_record_is_stale(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save("step-1")
    killed = _layout.new_save_id()
    # a save killed while overwriting step-1, and one killed in a fresh step-2
    store.put(f"step-1/__0_0-{killed}.distcp", b"x" * 10)
    store.put(f"step-1/{_layout.live_name(killed)}", b"{}")
    store.put(f"step-2/__0_0-{killed}.distcp", b"y" * 10)
    store.put(f"step-2/{_layout.live_name(killed)}", b"{}")
    assert statuses(store)["step-2"] == "incomplete"  # a live record is a checkpoint file

    before = store.names()
    fresh = catalog.gc(store.root, older_than_s=0, storage_options=store.options, dry_run=False)
    assert fresh.empty and sum(killed in s for s in fresh.skipped) == 2
    assert store.names() == before

    monkeypatch.setattr(_layout, "LIVE_STALE_S", 0.0)  # as if two minutes had passed
    stale = catalog.gc(store.root, older_than_s=0, storage_options=store.options, dry_run=False)
    assert stale.incomplete == [store.url("step-2")]
    assert sorted(stale.leftovers) == sorted(
        store.url(f"step-1/{n}") for n in (f"__0_0-{killed}.distcp", _layout.live_name(killed))
    )
    assert store.names("step-2") == [] and not any(killed in n for n in store.names("step-1"))
    assert store.load("step-1") == 1.0


def test_gc_leaves_the_multipart_uploads_of_a_running_save(
    moto: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _s3_store(moto)
    bucket = moto.bucket
    running = _layout.new_save_id()
    store.put(f"step-1/{_layout.live_name(running)}", b"{}")
    key = store.path(f"step-1/__0_0-{running}.distcp").split("/", 1)[1]
    store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)

    def uploads() -> list[str]:
        found = store.fs.call_s3(
            "list_multipart_uploads", Bucket=bucket, Prefix=key.split("/", 1)[0]
        )
        return [u["Key"] for u in found.get("Uploads", [])]

    # moto dates every upload in 2010: only the live record says the save is running
    report = catalog.gc(store.root, older_than_s=0, storage_options=store.options, dry_run=False)
    assert report.uploads == [] and uploads() == [key]
    assert any(running in s and "upload" in s for s in report.skipped)

    monkeypatch.setattr(_layout, "LIVE_STALE_S", 0.0)
    report = catalog.gc(store.root, older_than_s=0, storage_options=store.options, dry_run=False)
    assert [u["key"] for u in report.uploads] == [f"{bucket}/{key}"] and uploads() == []


def test_a_running_save_refreshes_its_live_record_and_removes_it_at_the_end(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_layout, "LIVE_REFRESH_S", 0.3)
    box: dict[str, Any] = {}
    save = _slow_save(store, "step-1", 3.0, box)
    seen: list[tuple[str, float]] = []
    while save.is_alive():
        store.fs.invalidate_cache()
        for path, info in store.fs.find(store.path("step-1"), detail=True).items():
            if _layout.live_save_id_of(path.rsplit("/", 1)[-1]):
                mtime = info.get("mtime") or info["LastModified"].timestamp()
                seen.append((path, float(mtime)))
        time.sleep(0.1)
    save.join()
    assert "error" not in box, box.get("error")
    assert len({p for p, _ in seen}) == 1, "one live record per save"
    # (S3 listings give whole seconds: a save of ~3 s shows at least two of them)
    assert len({t for _, t in seen}) >= 2, "the live record was not rewritten while uploading"
    assert not any(n.startswith(_layout.LIVE_PREFIX) for n in store.names("step-1"))


def test_a_failed_save_removes_its_live_record(local: Store) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            raise RuntimeError("simulated failure while serializing")

    with pytest.raises(CheckpointException):
        dcp.save(
            state_of(1.0), storage_writer=local.writer("step-1"), planner=Failing(), **no_dist()
        )
    assert local.names("step-1") == []


# --------------------------------------------------------------------------------------------
# 3. the writer never commits a save with missing objects


def _vanish(store: Store, rel: str, name: str) -> None:
    store.rm(f"{rel}/{name}")


def _truncate(store: Store, rel: str, name: str) -> None:
    data = store.cat(f"{rel}/{name}")
    store.put(f"{rel}/{name}", data[: len(data) // 2])


class _DamagingWriter(VolumeWriter):
    """Damages one of its own shards behind its back just before it commits."""

    damage: Any = None
    store: Store | None = None
    rel = ""

    def finish(self, metadata: Any, results: Any) -> None:
        shard = results[0][0].storage_data.relative_path
        type(self).damage(self.store, self.rel, shard)
        super().finish(metadata, results)


@pytest.mark.parametrize("damage", [_vanish, _truncate], ids=["deleted", "truncated"])
@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "new-path"])
def test_a_save_whose_shard_is_damaged_before_commit_fails_and_commits_nothing(
    store: Store, damage: Any, overwrite: bool
) -> None:
    store.save("step-1", 1.0)
    before = store.names("step-1")
    rel = "step-1" if overwrite else "step-2"
    writer_cls = type(
        "W", (_DamagingWriter,), {"damage": staticmethod(damage), "store": store, "rel": rel}
    )
    writer = writer_cls(store.url(rel), storage_options=store.options, overwrite=overwrite)

    with pytest.raises(CheckpointException) as info:
        dcp.save(state_of(2.0, n=4), storage_writer=writer, **no_dist())

    (err,) = failures_of(info.value)
    assert isinstance(err, errors.UploadError) and "was not committed" in str(err)
    assert "__0_0-" in str(err)
    assert store.load("step-1") == 1.0  # the previous checkpoint is untouched
    assert store.names("step-1") == before  # and nothing of the failed save is left
    if not overwrite:
        assert store.names("step-2") == []
        with pytest.raises(errors.CheckpointNotFoundError):
            VolumeReader(store.url("step-2"), storage_options=store.options).read_metadata()


def test_the_check_before_commit_trusts_a_size_lookup_over_a_lagging_listing(
    local: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_volumes.backends import Backend

    async def empty_scan(self: Backend) -> list[Any]:
        return []  # a store whose listing has not caught up with its writes

    monkeypatch.setattr(Backend, "scan", empty_scan)
    local.save("step-1", 5.0)
    monkeypatch.undo()
    assert local.load("step-1") == 5.0


def test_a_listing_that_reads_nothing_stays_torch_free(local: Store) -> None:
    local.save("step-1")
    code = (
        "import sys\n"
        "from dcp_volumes import catalog\n"
        f"infos = catalog.list_checkpoints({local.root!r}, check=0)\n"
        "assert [i.status for i in infos] == ['committed'], infos\n"
        "assert 'torch' not in sys.modules, 'a listing that reads nothing imported torch'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr


def test_gc_leaves_a_fresh_commit_temp_file_alone_whatever_the_threshold(local: Store) -> None:
    """A commit's temp file lives milliseconds, and a listing can show it after the rename
    and the live record's removal: gc takes one only once it is older than a live record
    may be (it once took the running commit's own at --older-than 0)."""
    local.save("step-1")
    base = local.path("step-1")
    fresh, old = f"{base}/.metadata.00000001-aaaaaaaaaaaa.tmp", f"{base}/.metadata.tmp"
    for path in (fresh, old):
        with open(path, "wb") as f:
            f.write(b"partial")
    past = time.time() - 2 * _layout.LIVE_STALE_S
    os.utime(old, (past, past))
    report = catalog.gc(local.root, older_than_s=0, dry_run=False)
    assert report.leftovers == [f"{local.url('step-1')}/.metadata.tmp"]
    assert os.path.exists(fresh) and not os.path.exists(old)
    assert local.load("step-1") == 1.0
