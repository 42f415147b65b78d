"""The dcp_volumes conformance suite: a pytest base class every backend's test module subclasses.

Usage (see ``docs/conformance.md``)::

    from dcp_volumes.testing.suite import CheckpointStoreTests, Store

    class TestMyStore(CheckpointStoreTests):
        conditional_create = True            # capability flags, see below

        @pytest.fixture
        def store(self, my_server) -> Store:
            return Store(root="myproto://bucket/prefix-" + uuid4().hex, storage_options={...})

Every check reads and writes "behind the writer's back" through :attr:`Store.raw_fs`, a
separate fsspec instance, so the code under test never checks itself. A capability a
backend lacks is declared by a class attribute, and the tests that need it skip with the
reason.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_volumes import (
    RetryOptions,
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    VolumeWriter,
    errors,
)
from dcp_volumes._compat import HAS_PROCESS_ASYNC_SAVE, TORCH_VERSION, no_dist
from dcp_volumes.backends import backend_class
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.scenarios import async_save_on_ranks, load_on_ranks, save_on_ranks
from dcp_volumes.testing.states import assert_state_equal, mixed_state, zeros_like_state

__all__ = ["CheckpointStoreTests", "SlowPlanner", "Store", "failures_of"]

MiB = 1 << 20
SMALL_PARTS = TransferOptions(part_size=5 * MiB, max_concurrency=4)
FAST_RETRY = RetryOptions(max_attempts=6, initial_backoff_s=0.02, max_backoff_s=0.2)


@dataclass
class Store:
    """What a backend gives the suite for one test.

    Attributes:
        root: a fresh, empty URL prefix for this test (checkpoints go under it).
        storage_options: fsspec options for the writer and reader.
        proxied_options: a factory returning options that reach the same store through a
            running :class:`~dcp_volumes.testing.faultproxy.FaultProxy`, and that proxy;
            ``None`` when the backend is not reached over HTTP.
        bad_credentials: options with wrong credentials (``None``: the store checks none).
        missing_bucket_root: a URL in a bucket/container that does not exist (``None``: n/a).
        secrets: strings that must never appear in logs or error messages.
    """

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    proxied_options: Callable[[], tuple[dict[str, Any], Any]] | None = None
    bad_credentials: dict[str, Any] | None = None
    missing_bucket_root: str | None = None
    secrets: tuple[str, ...] = ()

    def url(self, name: str | None = None) -> str:
        return f"{self.root.rstrip('/')}/{name or uuid.uuid4().hex[:12]}"

    @property
    def raw_fs(self) -> fsspec.AbstractFileSystem:
        """A separate fsspec instance for checks behind the writer's back."""
        protocol = self.root.split("://", 1)[0] if "://" in self.root else "file"
        return fsspec.filesystem(protocol, skip_instance_cache=True, **self.storage_options)

    def raw_path(self, url: str) -> str:
        return fsspec.core.strip_protocol(url) if "://" in url else os.path.abspath(url)

    def names(self, url: str) -> list[str]:
        fs = self.raw_fs
        path = self.raw_path(url)
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        except FileNotFoundError:
            return []


def failures_of(exc: BaseException) -> list[BaseException]:
    """The original exceptions inside DCP's ``CheckpointException``."""
    assert isinstance(exc, CheckpointException), repr(exc)
    return [err for err, _tb in exc.failures.values()]


class SlowPlanner(DefaultSavePlanner):
    """Sleeps before resolving each item: makes a save slow enough to observe or kill."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def resolve_data(self, write_item: Any) -> Any:
        time.sleep(self.delay_s)
        return super().resolve_data(write_item)


def _save(state: dict[str, Any], url: str, store: Store, **kw: Any) -> VolumeWriter:
    opts = kw.pop("storage_options", store.storage_options)
    planner = kw.pop("planner", None)
    writer = VolumeWriter(url, storage_options=opts,
                          transfer=kw.pop("transfer", SMALL_PARTS), **kw)
    dcp.save(state, storage_writer=writer, planner=planner, **no_dist())
    return writer


def _load(state: dict[str, Any], url: str, store: Store, **kw: Any) -> VolumeReader:
    opts = kw.pop("storage_options", store.storage_options)
    reader = VolumeReader(url, storage_options=opts, **kw)
    dcp.load(state, storage_reader=reader, **no_dist())
    return reader


def _versioned(v: float) -> dict[str, Any]:
    return {"a": torch.full((20_000,), v), "b": torch.full((3, 700), v), "v": v}


class CheckpointStoreTests:
    """Conformance tests every dcp_volumes backend must pass.

    Capability flags. The first four are read from the backend that serves the store's URL
    (:class:`~dcp_volumes.backends.base.Backend`'s class attributes named in brackets);
    a test class overrides one by setting it to ``True``/``False``:
        multi_process: the store is visible from other processes (False for ``memory://``)
            [``shared_across_processes``].
        conditional_create: the backend can create ``.metadata`` exclusively
            [``conditional_create``].
        retries_visible: transient errors reach dcp_volumes' retry loop (and so its
            figures); False where the client retries inside its own streaming writer
            [``retries_visible``].
        multipart_listing: stale multipart uploads can be listed (S3) [``lists_stale_uploads``].
        verifies_upload_checksums: the store (the server, not the client) checks the CRC32C
            each upload request carries and refuses a body damaged in transit (so the writer
            resends it); elsewhere the damage is stored and caught by the reader's own
            CRC32C on load.
        persistent_fault_timeout_s: how long a save may take to give up on a dead store.
    """

    multi_process: bool | None = None
    conditional_create: bool | None = None
    retries_visible: bool | None = None
    multipart_listing: bool | None = None
    verifies_upload_checksums: bool = False
    persistent_fault_timeout_s: float = 60.0

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a backend's test class must provide the `store` fixture")

    # ---- helpers ---------------------------------------------------------------------
    _BACKEND_CAPABILITY: ClassVar[dict[str, str]] = {
        "multi_process": "shared_across_processes",
        "conditional_create": "conditional_create",
        "retries_visible": "retries_visible",
        "multipart_listing": "lists_stale_uploads",
    }

    def _has(self, store: Store, flag: str) -> bool:
        """The capability ``flag``: the class's override, else the backend's own property."""
        value = getattr(self, flag)
        if value is None:
            value = getattr(backend_class(store.root), self._BACKEND_CAPABILITY[flag])
        return bool(value)

    def _need(self, store: Store, flag: str, reason: str) -> None:
        if not self._has(store, flag):
            pytest.skip(f"{type(self).__name__}: {reason}")

    @contextlib.contextmanager
    def _proxy(self, store: Store) -> Iterator[tuple[dict[str, Any], Any]]:
        if store.proxied_options is None:
            pytest.skip("this backend is not reached over HTTP: no fault injection")
        opts, proxy = store.proxied_options()
        proxy.clear_rules()
        try:
            yield opts, proxy
        finally:
            proxy.clear_rules()

    # ---- 1. round trip ---------------------------------------------------------------
    @pytest.mark.parametrize("mode", ["disk", "memory"], ids=["disk-spool", "memory-spool"])
    def test_round_trip_mixed_state(self, store: Store, mode: str) -> None:
        url = store.url()
        state = mixed_state()
        writer = _save(state, url, store, spool=SpoolOptions(mode=cast(Any, mode)))
        assert writer.last_stats is not None and writer.last_stats.parts >= 3
        out = zeros_like_state(state)
        reader = _load(out, url, store)
        assert_state_equal(out, state)
        assert reader.last_stats is not None and reader.last_stats.verified

    # ---- 2. multi-rank and resharding --------------------------------------------------
    @pytest.mark.parametrize(("save_ws", "load_ws"), [(2, (1, 3)), (4, (4, 2))],
                             ids=["save2-load1-load3", "save4-load4-load2"])
    def test_multi_rank_resharding(self, store: Store, save_ws: int,
                                   load_ws: tuple[int, ...]) -> None:
        self._need(store, "multi_process", "the store is private to one process")
        url = store.url()
        kw = {"storage_options": store.storage_options, "transfer": SMALL_PARTS}
        stats = run_ranks(save_ws, save_on_ranks, url, kw)
        assert sum(s["bytes"] > 0 for s in stats) >= 2  # replicated writes are spread
        for ws in load_ws:
            loaded = run_ranks(ws, load_on_ranks, url, {"storage_options": store.storage_options})
            assert all(s["verified"] for s in loaded)
            # a rank fetches what its new shards need, rounded to 1 MiB checksum blocks
            assert all(s["bytes_fetched"] <= 1.1 * s["bytes_needed"] + 2 * MiB for s in loaded)

    # ---- 3. async_save ------------------------------------------------------------------
    @pytest.mark.parametrize("checkpointer", ["thread", "process"], ids=["thread", "process"])
    def test_async_save_training_continues(self, store: Store, checkpointer: str) -> None:
        self._need(store, "multi_process", "async_save needs a process group and a shared store")
        if checkpointer == "process" and not HAS_PROCESS_ASYNC_SAVE:
            pytest.skip(f"needs dcp.async_save(async_checkpointer_type=AsyncCheckpointerType"
                        f".PROCESS), which torch {TORCH_VERSION} lacks")
        url = store.url()
        opts = store.storage_options
        proxy = None
        if store.proxied_options is not None:
            opts, proxy = store.proxied_options()
            from dcp_volumes.testing.faultproxy import FaultRule

            proxy.clear_rules()
            proxy.add_rule(FaultRule(action="delay", method="PUT", delay_s=0.3, times=None))
        try:
            out = run_ranks(2, async_save_on_ranks, url, {"storage_options": opts,
                                                          "transfer": SMALL_PARTS}, checkpointer)
        finally:
            if proxy is not None:
                proxy.clear_rules()
        for o in out:
            assert o["blocked_s"] < o["total_s"]
            if proxy is not None:  # uploads were slowed: training must have made progress
                assert o["steps_during_upload"] > 0
        run_ranks(1, load_on_ranks, url, {"storage_options": store.storage_options})

    # ---- 4. .metadata never visible early ----------------------------------------------
    def test_metadata_invisible_until_data_durable(self, store: Store) -> None:
        url = store.url()
        fs, root = store.raw_fs, store.raw_path(url)
        state = {f"t{i}": torch.randn(50_000) for i in range(8)}
        observations: list[tuple[bool, bool]] = []  # (metadata seen, all shards complete)
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                fs.invalidate_cache()
                seen = fs.exists(f"{root}/.metadata")
                complete = False
                if seen:
                    complete = _shards_complete(fs, root)
                observations.append((seen, complete))
                if seen:
                    return
                time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            _save(state, url, store, planner=SlowPlanner(0.15))
        finally:
            time.sleep(0.5)
            stop.set()
            poller.join(30)
        before = [o for o in observations if not o[0]]
        after = [o for o in observations if o[0]]
        assert len(before) >= 5, "the poller did not observe the save in progress"
        assert after and all(complete for _, complete in after)

    # ---- 5. killed mid-upload ----------------------------------------------------------
    def test_killed_mid_save_leaves_no_metadata(self, store: Store, tmp_path: Any) -> None:
        self._need(store, "multi_process", "the store is private to one process")
        url = store.url()
        script = tmp_path / "victim.py"
        script.write_text(textwrap.dedent(f"""
            import pickle, sys, torch, torch.distributed.checkpoint as dcp
            from dcp_volumes import VolumeWriter, SpoolOptions, TransferOptions
            from dcp_volumes._compat import no_dist
            from dcp_volumes.testing.suite import SlowPlanner
            opts = pickle.loads(bytes.fromhex(sys.argv[1]))
            state = {{f"t{{i}}": torch.randn(400_000) for i in range(40)}}
            print("start", flush=True)
            # 20 files of 2 items: the first shard is complete (visible) after ~0.2 s of a
            # save that takes >= 4 s, so the kill lands mid-save even on a loaded machine.
            dcp.save(state, storage_writer=VolumeWriter({url!r}, storage_options=opts,
                     spool=SpoolOptions(files_per_rank=20),
                     transfer=TransferOptions(part_size=5 << 20, max_concurrency=2)),
                     planner=SlowPlanner(0.1), **no_dist())
            print("done", flush=True)
        """))
        proc = subprocess.Popen([sys.executable, str(script),
                                 pickle.dumps(store.storage_options).hex()],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if any(n.endswith(".distcp") for n in store.names(url)):
                    break
                assert proc.poll() is None, proc.stdout.read().decode()[-2000:]  # type: ignore[union-attr]
                time.sleep(0.1)
            else:
                pytest.fail("the victim never uploaded a shard")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            output = proc.stdout.read().decode()  # type: ignore[union-attr]
            assert "done" not in output, "the save finished before it could be killed"
            assert proc.returncode == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert ".metadata" not in store.names(url)
        with pytest.raises(errors.IncompleteCheckpointError):
            VolumeReader(url, storage_options=store.storage_options).read_metadata()
        state = _versioned(7.0)
        _save(state, url, store)
        out = _versioned(0.0)
        _load(out, url, store)
        assert_state_equal(out, state)

    # ---- 6. transient faults -----------------------------------------------------------
    def test_transient_faults_are_retried(self, store: Store) -> None:
        from dcp_volumes.testing.faultproxy import FaultRule

        with self._proxy(store) as (opts, proxy):
            writes = _write_matcher(store)
            rules = [
                proxy.add_rule(FaultRule(action="status", status=503, times=3,
                                         body=_busy_body(store), name="503 burst", **writes)),
                proxy.add_rule(FaultRule(action="reset", skip=1, times=2, name="resets",
                                         **writes)),
                proxy.add_rule(FaultRule(action="status", status=500, times=1,
                                         body=_busy_body(store, 500), name="commit 500",
                                         **_write_matcher(store, "metadata"))),
                proxy.add_rule(FaultRule(action="status", status=503, method="GET", times=2,
                                         path_regex="distcp", body=_busy_body(store),
                                         name="read 503")),
            ]
            state = mixed_state(many=20)
            url = store.url()
            writer = _save(state, url, store, storage_options=opts, retry=FAST_RETRY)
            out = zeros_like_state(state)
            reader = _load(out, url, store, storage_options=opts, retry=FAST_RETRY)
            per_rule = [proxy.stats.rule(r) for r in rules]
        injected = sum(r.injected for r in per_rule)
        assert_state_equal(out, state)
        assert injected >= 4
        if self._has(store, "retries_visible"):
            assert writer.last_stats is not None and reader.last_stats is not None
            assert writer.last_stats.retries + reader.last_stats.retries >= 3, (
                writer.last_stats, reader.last_stats, per_rule)

    def test_upload_damaged_in_transit_never_loads(self, store: Store) -> None:
        from dcp_volumes.testing.faultproxy import FaultRule

        with self._proxy(store) as (opts, proxy):
            rule = proxy.add_rule(FaultRule(action="corrupt", times=1, name="flipped byte",
                                            **_data_write_matcher(store)))
            state = {"w": torch.randn(3 * MiB)}  # 12 MiB: several parts
            url = store.url()
            writer = _save(state, url, store, storage_options=opts, retry=FAST_RETRY,
                           spool=SpoolOptions(files_per_rank=1))
            assert proxy.stats.rule(rule).injected == 1
        out = {"w": torch.zeros(3 * MiB)}
        if self.verifies_upload_checksums:
            _load(out, url, store)
            assert_state_equal(out, state)
            assert writer.last_stats is not None and writer.last_stats.retries >= 1
        else:
            with pytest.raises(CheckpointException) as info:
                _load(out, url, store)
            (err,) = failures_of(info.value)
            assert isinstance(err, errors.IntegrityError), err
            assert "checksum mismatch" in str(err)

    # ---- 7. persistent fault -------------------------------------------------------------
    def test_persistent_fault_fails_cleanly(self, store: Store) -> None:
        from dcp_volumes.testing.faultproxy import FaultRule

        with self._proxy(store) as (opts, proxy):
            # Let the first upload request through so there is something to clean up.
            proxy.add_rule(FaultRule(action="status", status=503, skip=1, times=None,
                                     body=_busy_body(store), name="dead store",
                                     **_write_matcher(store)))
            url = store.url()
            start = time.monotonic()
            with pytest.raises(CheckpointException) as info:
                _save({"a": torch.randn(4 * MiB)}, url, store, storage_options=opts,
                      retry=RetryOptions(max_attempts=3, initial_backoff_s=0.01,
                                         max_backoff_s=0.05),
                      spool=SpoolOptions(files_per_rank=1))
            elapsed = time.monotonic() - start
        errs = failures_of(info.value)
        assert any(isinstance(e, errors.UploadError) for e in errs), errs
        assert elapsed < self.persistent_fault_timeout_s
        assert ".metadata" not in store.names(url)
        if self._has(store, "multipart_listing"):
            assert _open_multipart_uploads(store, url) == []

    # ---- 8. overwrite semantics --------------------------------------------------------
    def test_overwrite_false_fails_before_uploading(self, store: Store) -> None:
        url = store.url()
        _save(_versioned(1.0), url, store)
        before = store.names(url)
        with pytest.raises(CheckpointException) as info:
            _save(_versioned(2.0), url, store)
        assert any(isinstance(e, errors.CheckpointExistsError) for e in failures_of(info.value))
        assert store.names(url) == before

    def test_overwrite_under_concurrent_reader_never_mixes(self, store: Store) -> None:
        url = store.url()
        _save(_versioned(0.0), url, store)
        stop = threading.Event()
        seen: list[float] = []
        problems: list[str] = []

        def reader_loop() -> None:
            while not stop.is_set():
                out = _versioned(-1.0)
                try:
                    _load(out, url, store)
                except BaseException as exc:  # noqa: BLE001 — an old save vanished mid-read
                    errs = failures_of(exc) if isinstance(exc, CheckpointException) else [exc]
                    if not all(isinstance(e, (errors.IntegrityError, AssertionError,
                                              errors.DCPVolumesError)) for e in errs):
                        problems.append(repr(errs))
                    continue
                va, vb = out["a"][0].item(), out["b"][0, 0].item()
                if not (torch.all(out["a"] == va) and torch.all(out["b"] == va) and va == vb
                        and out["v"] == va):
                    problems.append(f"mixed data: a={va} b={vb} v={out['v']}")
                seen.append(va)

        t = threading.Thread(target=reader_loop, daemon=True)
        t.start()
        try:
            for v in (1.0, 2.0, 3.0):
                _save(_versioned(v), url, store, overwrite=True)
        finally:
            time.sleep(0.3)
            stop.set()
            t.join(60)
        assert not problems, problems[:3]
        assert seen, "the reader never completed a load"
        final = _versioned(-1.0)
        _load(final, url, store)
        assert final["v"] == 3.0

    def test_concurrent_first_saves_exactly_one_commits(self, store: Store) -> None:
        self._need(store, "conditional_create", "no conditional create on this backend")
        url = store.url()
        barrier = threading.Barrier(2)
        outcomes: dict[float, BaseException | None] = {}

        class MeetPlanner(DefaultSavePlanner):
            def create_global_plan(self, all_plans: Any) -> Any:
                out = super().create_global_plan(all_plans)
                barrier.wait(timeout=60)  # both have passed the existence check
                return out

        def run(v: float) -> None:
            try:
                _save(_versioned(v), url, store, planner=MeetPlanner())
                outcomes[v] = None
            except BaseException as exc:  # noqa: BLE001
                outcomes[v] = exc

        threads = [threading.Thread(target=run, args=(v,)) for v in (1.0, 2.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        winners = [v for v, e in outcomes.items() if e is None]
        losers = [e for e in outcomes.values() if e is not None]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert any(isinstance(e, errors.CheckpointExistsError) for e in failures_of(losers[0]))
        out = _versioned(0.0)
        _load(out, url, store)
        assert out["v"] == winners[0]
        manifests = [n for n in store.names(url) if n.startswith(".dcpv-manifest-")]
        assert len(manifests) == 1  # the loser removed its objects

    # ---- 9. integrity ---------------------------------------------------------------------
    @pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "missing-shard",
                                        "replaced-metadata"])
    def test_damage_is_detected(self, store: Store, damage: str) -> None:
        url = store.url()
        _save({"w": torch.randn(5000)}, url, store, spool=SpoolOptions(files_per_rank=1))
        fs, root = store.raw_fs, store.raw_path(url)
        shard = next(p for p in fs.ls(root, detail=False) if p.endswith(".distcp"))
        name = shard.rstrip("/").rsplit("/", 1)[-1]
        if damage == "flipped-byte":
            data = bytearray(fs.cat_file(shard))
            data[len(data) - 200] ^= 0x10
            fs.pipe_file(shard, bytes(data))
            expect = "checksum mismatch"
        elif damage == "truncated":
            fs.pipe_file(shard, fs.cat_file(shard)[:-50])
            expect = "truncated"
        elif damage == "missing-shard":
            fs.rm_file(shard)
            expect = "missing"
        else:
            other = store.url()
            _save({"w": torch.randn(5000)}, other, store)
            fs.pipe_file(f"{root}/.metadata", fs.cat_file(f"{store.raw_path(other)}/.metadata"))
            with pytest.raises(errors.IntegrityError, match="manifest"):
                VolumeReader(url, storage_options=store.storage_options).read_metadata()
            return
        with pytest.raises(CheckpointException) as info:
            _load({"w": torch.zeros(5000)}, url, store)
        (err,) = failures_of(info.value)
        assert isinstance(err, errors.IntegrityError), err
        assert expect in str(err) and name in str(err) and "'w'" in str(err)

    # ---- 10. bad input ---------------------------------------------------------------------
    @pytest.mark.parametrize("case", ["unknown-scheme", "malformed-url", "missing-bucket",
                                      "wrong-credentials", "path-is-a-file", "empty-state"])
    def test_bad_input_fails_clearly(self, store: Store, case: str) -> None:
        url = store.url()
        state: dict[str, Any] = {"a": torch.ones(10)}
        opts = store.storage_options
        if case == "unknown-scheme":
            with pytest.raises(errors.ConfigError, match="unknown URL scheme"):
                VolumeWriter("nosuchfs://bucket/x")
            return
        if case == "malformed-url":
            with pytest.raises(errors.ConfigError):
                VolumeWriter("s3:///no-bucket")
            return
        if case == "missing-bucket":
            if store.missing_bucket_root is None:
                pytest.skip("no buckets on this backend")
            url = store.missing_bucket_root + "/ckpt"
            expected: type[BaseException] = errors.BucketNotFoundError
        elif case == "wrong-credentials":
            if store.bad_credentials is None:
                pytest.skip("this server does not check credentials")
            opts = store.bad_credentials
            expected = errors.StoragePermissionError
        elif case == "path-is-a-file":
            fs = store.raw_fs
            path = store.raw_path(url)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.pipe_file(path, b"not a directory")
            expected = errors.ConfigError
        else:
            state = {}
            expected = errors.ConfigError
        start = time.monotonic()
        with pytest.raises(CheckpointException) as info:
            _save(state, url, store, storage_options=opts,
                  retry=RetryOptions(max_attempts=2, initial_backoff_s=0.01))
        assert time.monotonic() - start < 60
        errs = failures_of(info.value)
        assert any(isinstance(e, expected) for e in errs), errs
        assert all(str(e) for e in errs)
        if case == "path-is-a-file":
            assert store.raw_fs.cat_file(store.raw_path(url)) == b"not a directory"
        elif case != "missing-bucket":
            assert store.names(url) == []

    # ---- 11. security -------------------------------------------------------------------------
    def test_crafted_metadata_is_refused(self, store: Store) -> None:
        url = store.url()
        _save({"a": torch.ones(3)}, url, store)
        store.raw_fs.pipe_file(f"{store.raw_path(url)}/.metadata", pickle.dumps(_Evil()))
        with pytest.raises(errors.UnsafeCheckpointError):
            VolumeReader(url, storage_options=store.storage_options).read_metadata()

    def test_manifest_paths_cannot_escape(self, store: Store) -> None:
        url = store.url()
        _save({"a": torch.ones(3)}, url, store)
        fs, root = store.raw_fs, store.raw_path(url)
        metadata = pickle.loads(fs.cat_file(f"{root}/.metadata"))
        for info in metadata.storage_data.values():
            info.relative_path = "../../other-run/__0_0.distcp"
        fs.pipe_file(f"{root}/.metadata", pickle.dumps(metadata))
        with pytest.raises(errors.UnsafeCheckpointError, match="escapes"):
            VolumeReader(url, storage_options=store.storage_options).read_metadata()

    def test_credentials_never_logged(self, store: Store, caplog: pytest.LogCaptureFixture) -> None:
        if not store.secrets:
            pytest.skip("this backend has no credentials")
        url = store.url()
        texts: list[str] = []
        with caplog.at_level(logging.DEBUG):
            _save({"a": torch.ones(3)}, url, store)
            _load({"a": torch.zeros(3)}, url, store)
            if store.bad_credentials is not None:
                with pytest.raises(CheckpointException) as info:
                    _save({"a": torch.ones(3)}, store.url(), store,
                          storage_options=store.bad_credentials,
                          retry=RetryOptions(max_attempts=1))
                texts += [str(e) + repr(e) for e in failures_of(info.value)]
        texts += [r.getMessage() for r in caplog.records]
        texts.append(repr(VolumeWriter(url, storage_options=store.storage_options)))
        for secret in store.secrets:
            assert not any(secret in t for t in texts), "a credential leaked into logs/errors"


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def _write_matcher(store: Store, name_regex: str = "") -> dict[str, Any]:
    """FaultRule fields matching object writes: PUTs on S3 and Azure, uploads on GCS."""
    if store.root.startswith(("gs", "gcs")):
        return {"path_regex": "/upload/" + (f".*{name_regex}" if name_regex else "")}
    return {"method": "PUT", **({"path_regex": name_regex} if name_regex else {})}


def _data_write_matcher(store: Store) -> dict[str, Any]:
    """FaultRule fields matching only the requests that carry shard bytes."""
    if store.root.startswith(("gs", "gcs")):
        return {"path_regex": "upload_id="}
    return {"method": "PUT", "path_regex": r"\.distcp"}


def _busy_body(store: Store, status: int = 503) -> bytes:
    from dcp_volumes.testing import faultproxy

    if store.root.startswith("s3"):
        return faultproxy.S3_SLOWDOWN_XML if status == 503 else faultproxy.S3_INTERNAL_ERROR_XML
    if store.root.startswith(("gs", "gcs")):
        return faultproxy.GCS_RATE_LIMIT_JSON
    return faultproxy.AZURE_SERVER_BUSY_XML


def _shards_complete(fs: fsspec.AbstractFileSystem, root: str) -> bool:
    """Every file named in the manifest exists with its full size."""
    import json

    names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    manifests = [n for n in names if n.startswith(".dcpv-manifest-")]
    if not manifests:
        return False
    doc = json.loads(fs.cat_file(f"{root}/{manifests[0]}"))
    for name, entry in doc["files"].items():
        try:
            if fs.info(f"{root}/{name}")["size"] != entry["size"]:
                return False
        except FileNotFoundError:
            return False
    return True


def _open_multipart_uploads(store: Store, url: str) -> list[str]:
    bucket, _, prefix = store.raw_path(url).partition("/")
    # Behind the writer's back: a separate s3fs instance's own client call.
    resp = store.raw_fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return [u["Key"] for u in resp.get("Uploads", [])]


_ = io
