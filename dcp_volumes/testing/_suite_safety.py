"""Conformance tests 8-11: overwrite and races, integrity, bad input, untrusted storage."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_volumes import (
    RetryOptions,
    SpoolOptions,
    VolumeReader,
    VolumeWriter,
    errors,
)
from dcp_volumes.testing._suite_support import (
    Evil,
    Store,
    SuiteBase,
    failures_of,
    load_with,
    save_with,
    versioned,
)


class SafetyTests(SuiteBase):
    # ---- 8. overwrite semantics --------------------------------------------------------
    def test_overwrite_false_fails_before_uploading(self, store: Store) -> None:
        url = store.url()
        save_with(versioned(1.0), url, store)
        before = store.names(url)
        with pytest.raises(CheckpointException) as info:
            save_with(versioned(2.0), url, store)
        assert any(isinstance(e, errors.CheckpointExistsError) for e in failures_of(info.value))
        assert store.names(url) == before

    def test_overwrite_under_concurrent_reader_never_mixes(self, store: Store) -> None:
        url = store.url()
        save_with(versioned(0.0), url, store)
        stop = threading.Event()
        seen: list[float] = []
        problems: list[str] = []

        def reader_loop() -> None:
            while not stop.is_set():
                out = versioned(-1.0)
                try:
                    load_with(out, url, store)
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
                save_with(versioned(v), url, store, overwrite=True)
        finally:
            time.sleep(0.3)
            stop.set()
            t.join(60)
        assert not problems, problems[:3]
        assert seen, "the reader never completed a load"
        final = versioned(-1.0)
        load_with(final, url, store)
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
                save_with(versioned(v), url, store, planner=MeetPlanner())
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
        out = versioned(0.0)
        load_with(out, url, store)
        assert out["v"] == winners[0]
        manifests = [n for n in store.names(url) if n.startswith(".dcpv-manifest-")]
        assert len(manifests) == 1  # the loser removed its objects

    # ---- 9. integrity ---------------------------------------------------------------------
    @pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "missing-shard",
                                        "replaced-metadata"])
    def test_damage_is_detected(self, store: Store, damage: str) -> None:
        url = store.url()
        save_with({"w": torch.randn(5000)}, url, store, spool=SpoolOptions(files_per_rank=1))
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
            save_with({"w": torch.randn(5000)}, other, store)
            fs.pipe_file(f"{root}/.metadata", fs.cat_file(f"{store.raw_path(other)}/.metadata"))
            with pytest.raises(errors.IntegrityError, match="manifest"):
                VolumeReader(url, storage_options=store.storage_options).read_metadata()
            return
        with pytest.raises(CheckpointException) as info:
            load_with({"w": torch.zeros(5000)}, url, store)
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
            save_with(state, url, store, storage_options=opts,
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
        save_with({"a": torch.ones(3)}, url, store)
        store.raw_fs.pipe_file(f"{store.raw_path(url)}/.metadata", pickle.dumps(Evil()))
        with pytest.raises(errors.UnsafeCheckpointError):
            VolumeReader(url, storage_options=store.storage_options).read_metadata()

    def test_manifest_paths_cannot_escape(self, store: Store) -> None:
        url = store.url()
        save_with({"a": torch.ones(3)}, url, store)
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
            save_with({"a": torch.ones(3)}, url, store)
            load_with({"a": torch.zeros(3)}, url, store)
            if store.bad_credentials is not None:
                with pytest.raises(CheckpointException) as info:
                    save_with({"a": torch.ones(3)}, store.url(), store,
                          storage_options=store.bad_credentials,
                          retry=RetryOptions(max_attempts=1))
                texts += [str(e) + repr(e) for e in failures_of(info.value)]
        texts += [r.getMessage() for r in caplog.records]
        texts.append(repr(VolumeWriter(url, storage_options=store.storage_options)))
        for secret in store.secrets:
            assert not any(secret in t for t in texts), "a credential leaked into logs/errors"



    # ---- 12. untrusted storage (issue 10) ----------------------------------------------------
    def test_object_items_cannot_run_code(self, store: Store, tmp_path: Any) -> None:
        marker = tmp_path / "ran"
        url = store.url()
        save_with({"w": torch.ones(4), "extra": Payload(str(marker))}, url, store)
        assert not marker.exists()
        with pytest.raises(CheckpointException) as info:
            load_with({"w": torch.zeros(4), "extra": None}, url, store)
        (err,) = failures_of(info.value)
        assert isinstance(err, errors.UnsafeCheckpointError), err
        assert "system" in str(err) and "safe_globals" in str(err)
        assert not marker.exists(), "loading ran a command from storage"

    def test_claimed_lengths_are_checked_before_reading(self, store: Store) -> None:
        url = store.url()
        save_with({"w": torch.arange(4096, dtype=torch.float32)}, url, store)
        fs, root = store.raw_fs, store.raw_path(url)
        metadata = pickle.loads(fs.cat_file(f"{root}/.metadata"))
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = type(info)(info.relative_path, info.offset, 4 << 40)
        fs.pipe_file(f"{root}/.metadata", pickle.dumps(metadata))
        start = time.monotonic()
        with pytest.raises(CheckpointException) as info:
            # verify=False: no manifest to disagree with, only the object's real size
            load_with({"w": torch.zeros(4096)}, url, store, verify=False)
        (err,) = failures_of(info.value)
        assert isinstance(err, errors.IntegrityError) and "truncated" in str(err), err
        assert time.monotonic() - start < 60  # one size lookup, not 4 TiB of GETs

    @pytest.mark.parametrize("case", ["shape-[0,10**30]", "chunk-outside-tensor",
                                      "metadata-dtype-lies", "manifest-dtype-lies"])
    def test_crafted_shapes_and_lying_dtypes_are_typed(self, store: Store, case: str) -> None:
        """Issue 25 (findings 8, 9): a crafted ``.metadata`` shape or chunk was a ``ValueError``
        or ``KeyError`` from torch's planner (an ``AssertionError`` message through
        ``dcp.load``), and a dtype that lies loaded reinterpreted values, verified. Each is
        an ``IntegrityError``, carried itself inside DCP's ``CheckpointException``."""
        url = store.url()
        big = torch.arange(1 << 20, dtype=torch.float32)  # a block layout: dtype in the manifest
        save_with({"w": big}, url, store)
        fs, root = store.raw_fs, store.raw_path(url)
        if case == "manifest-dtype-lies":
            (name,) = [n for n in store.names(url) if n.startswith(".dcpv-manifest-")]
            fs.pipe_file(f"{root}/{name}", fs.cat_file(f"{root}/{name}").replace(
                b'"dtype":"float32"', b'"dtype":"int32"'))
        else:
            metadata = pickle.loads(fs.cat_file(f"{root}/.metadata"))
            item = metadata.state_dict_metadata["w"]
            if case == "shape-[0,10**30]":
                item.size = torch.Size([0, 10**30])
            elif case == "chunk-outside-tensor":
                item.chunks[0].offsets = torch.Size([5])
            else:
                item.properties.dtype = torch.int32
            fs.pipe_file(f"{root}/.metadata", pickle.dumps(metadata))
        with pytest.raises(CheckpointException) as info:
            load_with({"w": torch.zeros(1 << 20)}, url, store)
        (err,) = failures_of(info.value)
        assert isinstance(err, errors.IntegrityError), repr(err)


class Payload:
    """An object whose unpickling runs a command (a hostile non-tensor item)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))
