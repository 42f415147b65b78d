"""The catalog: list, latest (one listing on N ranks), retention, remove, verify, describe, gc.

Runs against a local directory and a moto S3 server (started once for the module). Objects are
written and damaged "behind the store's back" with raw fsspec calls, so the catalog never checks
itself.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeReader, VolumeWriter, catalog, errors
from dcp_volumes._compat import no_dist
from dcp_volumes.backends import Backend
from dcp_volumes.backends.s3 import S3Backend
from dcp_volumes.catalog import _listing
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.servers import LocalServer, start_server

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SAVE_ID = "6a000000-0123456789ab"  # an old save id (2026-05) that no real save will reuse


# --------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def moto() -> Iterator[LocalServer]:
    server = start_server("moto")
    server.create_bucket("catalog")
    yield server
    server.stop()


class Store:
    """A run root plus raw access to it (for writing and damaging objects behind our back)."""

    def __init__(self, root: str, options: dict[str, Any]) -> None:
        self.root = root
        self.options = options
        if root.startswith("s3://"):
            self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        else:
            self.fs = fsspec.filesystem("file")

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}".removeprefix("s3://")

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def save(self, rel: str, value: float = 1.0, **writer_kwargs: Any) -> None:
        state = {"w": torch.full((2, 3), value), "meta": {"v": value}}
        dcp.save(
            state,
            storage_writer=VolumeWriter(
                self.url(rel), storage_options=self.options, **writer_kwargs
            ),
            **no_dist(),
        )

    def load(self, rel: str) -> dict[str, Any]:
        state = {"w": torch.zeros(2, 3), "meta": {"v": 0.0}}
        dcp.load(
            state,
            storage_reader=VolumeReader(self.url(rel), storage_options=self.options),
            **no_dist(),
        )
        return state

    def put(self, rel: str, data: bytes) -> None:
        if not self.root.startswith("s3://"):
            self.fs.makedirs(self.fs._parent(self.path(rel)), exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def names(self, rel: str = "") -> list[str]:
        self.fs.invalidate_cache()
        base = self.path(rel).rstrip("/") + "/"
        return sorted(p[len(base) :] for p in self.fs.find(base.rstrip("/")))


@pytest.fixture(params=["local", "moto"], ids=["local", "moto"])
def store(request: pytest.FixtureRequest, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "run"), {})
    server: LocalServer = request.getfixturevalue("moto")
    return Store(f"s3://catalog/{uuid.uuid4().hex[:12]}", server.storage_options())


@pytest.fixture
def local(tmp_path) -> Store:
    return Store(str(tmp_path / "run"), {})


def steps_of(infos: list[catalog.CheckpointInfo]) -> list[int | None]:
    return [i.step for i in infos]


# --------------------------------------------------------------------------------------------
# list


def test_list_groups_by_checkpoint_with_sizes_and_status(store: Store) -> None:
    t0 = time.time()
    for step in (10, 2, 1):
        store.save(f"step-{step:08d}", float(step))
    store.put(f"step-00000011/__0_0-{SAVE_ID}.distcp", b"x" * 100)  # killed save
    store.put("logs/train.txt", b"not a checkpoint")
    store.put("README", b"an object right under the root")

    before = _listing.listings_made()
    infos = catalog.list_checkpoints(store.root + "/", storage_options=store.options)
    assert _listing.listings_made() - before == 1  # one recursive listing, not one per checkpoint

    assert [i.name for i in infos] == [f"step-{s:08d}" for s in (1, 2, 10, 11)]
    assert steps_of(infos) == [1, 2, 10, 11]
    assert [i.complete for i in infos] == [True, True, True, False]
    for info in infos:
        rel = info.name
        sizes = {p: store.fs.info(store.path(f"{rel}/{p}"))["size"] for p in store.names(rel)}
        assert info.url == store.url(rel)
        assert info.objects == len(sizes) and info.bytes == sum(sizes.values())
    for info in infos[:3]:
        assert info.commit_time is not None and t0 - 5 <= info.commit_time <= time.time() + 5
    assert infos[3].commit_time is None and infos[3].last_modified is not None


@pytest.mark.parametrize(
    ("name", "pattern", "step"),
    [
        ("step-00000042", None, 42),
        ("step_42", None, 42),
        ("42", None, 42),
        ("ckpt-42", None, None),
        ("ckpt-42", r"^ckpt-(\d+)$", 42),
        ("epoch3-step42", r"step(?P<step>\d+)$", 42),
    ],
    ids=[
        "step-dash",
        "step-underscore",
        "bare-number",
        "no-match",
        "custom-group-1",
        "custom-named-group",
    ],
)
def test_step_pattern(local: Store, name: str, pattern: str | None, step: int | None) -> None:
    local.save(name)
    (info,) = catalog.list_checkpoints(local.root, step_pattern=pattern)
    assert info.name == name and info.step == step


def test_bad_step_pattern_is_a_config_error(local: Store) -> None:
    with pytest.raises(errors.ConfigError, match="regular expression"):
        catalog.list_checkpoints(local.root, step_pattern="step-(")


def test_missing_bucket_is_reported(moto: LocalServer) -> None:
    with pytest.raises(errors.BucketNotFoundError):
        catalog.list_checkpoints("s3://no-such-bucket/run", storage_options=moto.storage_options())


def test_empty_root_lists_nothing(store: Store) -> None:
    assert catalog.list_checkpoints(store.root, storage_options=store.options) == []
    assert catalog.latest(store.root, storage_options=store.options) is None


# --------------------------------------------------------------------------------------------
# latest


def test_latest_is_highest_complete_step(store: Store) -> None:
    store.save("step-00000009")
    store.save("step-00000010")
    store.put(f"step-00000011/__0_0-{SAVE_ID}.distcp", b"partial")
    info = catalog.latest(store.root, storage_options=store.options)
    assert info is not None and info.name == "step-00000010" and info.complete


def _latest_on_rank(
    rank: int, world_size: int, root: str, options: dict[str, Any]
) -> dict[str, Any]:
    before = _listing.listings_made()
    info = catalog.latest(root, storage_options=options)
    listed = _listing.listings_made() - before
    try:
        catalog.latest("s3://no-such-bucket/run", storage_options=options)
        error = None
    except errors.DCPVolumesError as exc:
        error = type(exc).__name__
    return {"url": info.url if info else None, "listings": listed, "error": error}


def test_latest_on_two_ranks_lists_once(moto: LocalServer) -> None:
    store = Store(f"s3://catalog/{uuid.uuid4().hex[:12]}", moto.storage_options())
    for step in (1, 2, 3):
        store.save(f"step-{step}")
    out = run_ranks(2, _latest_on_rank, store.root, store.options)
    assert [o["url"] for o in out] == [store.url("step-3")] * 2
    assert sum(o["listings"] for o in out) == 1  # rank 0 listed; rank 1 got the broadcast
    assert out[0]["listings"] == 1
    # an error on rank 0 reaches every rank (no rank waits forever)
    assert [o["error"] for o in out] == ["BucketNotFoundError"] * 2


# --------------------------------------------------------------------------------------------
# retention and remove


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "kept"),
    [
        (2, None, [8, 10, 12]),
        (None, 4, [4, 8, 10, 12]),
        (1, 4, [4, 8, 10, 12]),
        (3, 6, [6, 8, 10, 12]),
        (None, None, [2, 4, 6, 8, 10, 12]),
        (100, None, [2, 4, 6, 8, 10, 12]),
    ],
    ids=["last-2", "every-4", "last-1-and-every-4", "last-3-and-every-6", "no-policy", "last-100"],
)
def test_retention_policy(
    local: Store, keep_last: int | None, keep_every: int | None, kept: list[int]
) -> None:
    for step in (2, 4, 6, 8, 10):
        local.save(f"step-{step}")
    local.put(f"step-12/__0_0-{SAVE_ID}.distcp", b"being written")  # incomplete: never deleted
    local.save("manual-snapshot")  # no step: never deleted
    removed = catalog.apply_retention(local.root, keep_last=keep_last, keep_every=keep_every)
    left = catalog.list_checkpoints(local.root)
    assert [i.step for i in left if i.step is not None] == kept
    assert sorted(removed) == sorted(
        local.url(f"step-{s}") for s in (2, 4, 6, 8, 10) if s not in kept
    )
    assert any(i.name == "manual-snapshot" for i in left)


def test_retention_on_object_store_deletes_metadata_first(store: Store, monkeypatch) -> None:
    for step in (1, 2, 3):
        store.save(f"step-{step}")
    calls: list[list[str]] = []

    def spying(original: Any) -> Any:
        async def spy(self: Backend, relatives: list[str]) -> None:
            calls.append(list(relatives))
            await original(self, relatives)

        return spy

    # every backend's remove (S3 has its own: batched DeleteObjects)
    for cls in (Backend, S3Backend):
        monkeypatch.setattr(cls, "remove", spying(cls.__dict__["remove"]))
    assert catalog.apply_retention(
        store.root, keep_last=2, storage_options=store.options, dry_run=True
    ) == [store.url("step-1")]
    assert calls == [] and store.names("step-1")  # dry run: nothing touched
    assert catalog.apply_retention(store.root, keep_last=2, storage_options=store.options) == [
        store.url("step-1")
    ]
    assert calls[0] == ["step-1/.metadata"]  # alone, and before everything else
    assert ".metadata" not in " ".join(calls[1])
    assert store.names("step-1") == []
    assert store.load("step-3")["w"].sum() == 6.0


def test_newest_complete_is_kept_even_with_keep_every(local: Store) -> None:
    for step in (4, 5):
        local.save(f"step-{step}")
    assert catalog.apply_retention(local.root, keep_every=4) == []


@pytest.mark.parametrize(
    "bad",
    [{"keep_last": 0}, {"keep_every": -1}, {"keep_last": 1.5}],
    ids=["keep-last-0", "keep-every-negative", "keep-last-float"],
)
def test_retention_rejects_bad_counts(local: Store, bad: dict[str, Any]) -> None:
    with pytest.raises(errors.ConfigError, match="whole number"):
        catalog.apply_retention(local.root, **bad)


def test_remove_one_checkpoint(store: Store) -> None:
    store.save("step-1")
    store.save("step-2")
    objects = store.names("step-1")
    removed = catalog.remove(store.url("step-1"), storage_options=store.options)
    assert removed[0] == store.url("step-1/.metadata")
    assert sorted(removed) == sorted(store.url(f"step-1/{n}") for n in objects)
    assert [
        i.name for i in catalog.list_checkpoints(store.root, storage_options=store.options)
    ] == ["step-2"]
    with pytest.raises(errors.CheckpointNotFoundError):
        catalog.remove(store.url("step-1"), storage_options=store.options)
    with pytest.raises(errors.ConfigError, match="run root"):
        catalog.remove(store.root, storage_options=store.options)
    assert store.load("step-2")["w"].sum() == 6.0


# --------------------------------------------------------------------------------------------
# verify and describe


def _flip_a_byte(store: Store, rel: str) -> None:
    path = store.path(rel)
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.put(rel, bytes(data))


def _truncate(store: Store, rel: str) -> None:
    store.put(rel, store.fs.cat_file(store.path(rel))[:-10])


def _delete(store: Store, rel: str) -> None:
    store.fs.rm_file(store.path(rel))


@pytest.mark.parametrize(
    ("damage", "status"),
    [
        (None, "ok"),
        (_flip_a_byte, "checksum mismatch"),
        (_truncate, "size mismatch"),
        (_delete, "missing"),
    ],
    ids=["intact", "flipped-byte", "truncated", "deleted"],
)
def test_verify(store: Store, damage: Any, status: str) -> None:
    store.save("step-1")
    shard = next(n for n in store.names("step-1") if n.startswith("__0_0-"))
    if damage is not None:
        damage(store, f"step-1/{shard}")
    progress: list[tuple[int, int]] = []
    report = catalog.verify(
        store.url("step-1"),
        storage_options=store.options,
        chunk_size=64,
        progress=lambda d, t: progress.append((d, t)),
    )
    assert report.checksummed
    by_name = {f.name: f for f in report.files}
    assert by_name[shard].status == status
    assert report.ok == (status == "ok")
    if status == "checksum mismatch":
        assert by_name[shard].bad_items and "crc32c" in by_name[shard].bad_items[0]
        assert any("'w'" in b or "'meta" in b for b in by_name[shard].bad_items)
    if status == "ok":
        assert progress and progress[-1][0] == progress[-1][1] == report.bytes_read


def test_verify_torch_written_checkpoint_checks_presence_and_size(local: Store) -> None:
    url = local.url("step-1")
    dcp.save({"w": torch.ones(100)}, storage_writer=dcp.FileSystemWriter(url), **no_dist())
    report = catalog.verify(url)
    assert report.ok and not report.checksummed and "no manifest" in report.note
    _truncate(local, "step-1/__0_0.distcp")
    report = catalog.verify(url)
    assert not report.ok and report.files[0].status == "size mismatch"


def test_verify_and_describe_need_a_complete_checkpoint(local: Store) -> None:
    local.put(f"step-1/__0_0-{SAVE_ID}.distcp", b"x")
    with pytest.raises(errors.IncompleteCheckpointError):
        catalog.verify(local.url("step-1"))
    with pytest.raises(errors.CheckpointNotFoundError):
        catalog.describe(local.url("step-2"))


def test_describe(store: Store) -> None:
    state = {
        "model": {"w": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.arange(3)},
        "step": 7,
    }
    dcp.save(
        state,
        storage_writer=VolumeWriter(store.url("step-7"), storage_options=store.options),
        **no_dist(),
    )
    d = catalog.describe(store.url("step-7"), storage_options=store.options)
    entries = {e.key: e for e in d.entries}
    assert entries["model.w"].dtype == "bfloat16" and entries["model.w"].shape == [4, 8]
    assert entries["model.w"].nbytes == 64
    assert entries["model.b"].dtype == "int64" and entries["model.b"].nbytes == 24
    assert entries["step"].kind == "bytes" and entries["step"].stored_bytes > 0
    assert d.world_size == 1 and d.writer is not None and d.writer.startswith("dcp_volumes")
    assert d.checksummed and d.torch_version == torch.__version__
    assert d.save_time is not None and abs(d.save_time - time.time()) < 60
    assert d.objects == len(store.names("step-7")) and d.total_bytes > 0


# --------------------------------------------------------------------------------------------
# gc


def test_gc_collects_stale_leftovers_and_keeps_everything_else(store: Store) -> None:
    store.save("step-1")
    store.save("step-2")
    # a killed save (only DCP files, no .metadata), a directory that merely looks incomplete,
    # and inside step-2 the shard and manifest of a save that lost (another save id)
    store.put(f"step-3/__0_0-{SAVE_ID}.distcp", b"x" * 10)
    store.put(f"step-3/__1_0-{SAVE_ID}.distcp", b"y" * 10)
    store.put("step-4/notes.txt", b"mine")
    store.put(f"step-2/__0_0-{SAVE_ID}.distcp", b"z" * 10)
    store.put(f"step-2/.dcpv-manifest-{SAVE_ID}.json", b"{}")

    young = catalog.gc(store.root, storage_options=store.options)  # default: 1h, dry run
    assert young.dry_run and young.incomplete == [] and young.leftovers == []

    report = catalog.gc(store.root, older_than_s=0, storage_options=store.options)
    assert report.dry_run
    assert report.incomplete == [store.url("step-3")]
    assert sorted(report.leftovers) == sorted(
        [
            store.url(f"step-2/__0_0-{SAVE_ID}.distcp"),
            store.url(f"step-2/.dcpv-manifest-{SAVE_ID}.json"),
        ]
    )
    assert report.bytes == 32
    assert any("step-4" in s for s in report.skipped)
    assert len(store.names("step-3")) == 2  # dry run deleted nothing

    done = catalog.gc(store.root, older_than_s=0, storage_options=store.options, dry_run=False)
    assert done.incomplete == report.incomplete and done.leftovers == report.leftovers
    assert store.names("step-3") == []
    assert f"__0_0-{SAVE_ID}.distcp" not in store.names("step-2")
    assert store.names("step-4") == ["notes.txt"]
    assert store.load("step-2")["w"].sum() == 6.0 and store.load("step-1")["w"].sum() == 6.0
    assert catalog.gc(store.root, older_than_s=0, storage_options=store.options).empty


def test_gc_aborts_multipart_uploads_under_the_root_only(moto: LocalServer) -> None:
    store = Store(f"s3://catalog/{uuid.uuid4().hex[:12]}", moto.storage_options())
    store.save("step-1")
    inside = store.path(f"step-2/__0_0-{SAVE_ID}.distcp").split("/", 1)[1]
    outside = f"elsewhere-{uuid.uuid4().hex[:6]}/big.bin"
    for key in (inside, outside):
        store.fs.call_s3("create_multipart_upload", Bucket="catalog", Key=key)

    def uploads() -> set[str]:
        found = store.fs.call_s3("list_multipart_uploads", Bucket="catalog")
        return {u["Key"] for u in found.get("Uploads", [])}

    # moto dates every upload in 2010, so both count as stale; only the one under the root goes
    report = catalog.gc(store.root, storage_options=store.options, dry_run=False)
    assert [u["key"] for u in report.uploads] == [f"catalog/{inside}"]
    assert inside not in uploads() and outside in uploads()
