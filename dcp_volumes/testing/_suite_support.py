"""What the conformance suite's test groups share: the :class:`Store` a backend provides,
the capability machinery, save/load helpers, fault matchers and behind-the-back checks."""

from __future__ import annotations

import contextlib
import io
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_volumes import (
    RetryOptions,
    TransferOptions,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes._compat import no_dist
from dcp_volumes.backends import backend_class

__all__ = ["RankBudget", "SlowPlanner", "Store", "SuiteBase", "failures_of"]

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


class RankBudget:
    """One deadline shared by the spawned runs of a test: each run gets what is left, so
    the runs together stay within ``seconds`` and a hang is reported by the run it hit."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def next(self, label: str) -> dict[str, Any]:
        """``run_ranks`` keywords for the next run: its label and the time left."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"the multi-rank runs of this test took over {self.seconds:.0f} s "
                        f"before {label!r} could start")
        return {"timeout": left, "label": label}


def save_with(state: dict[str, Any], url: str, store: Store, **kw: Any) -> VolumeWriter:
    opts = kw.pop("storage_options", store.storage_options)
    planner = kw.pop("planner", None)
    writer = VolumeWriter(url, storage_options=opts,
                          transfer=kw.pop("transfer", SMALL_PARTS), **kw)
    dcp.save(state, storage_writer=writer, planner=planner, **no_dist())
    return writer


def load_with(state: dict[str, Any], url: str, store: Store, **kw: Any) -> VolumeReader:
    opts = kw.pop("storage_options", store.storage_options)
    reader = VolumeReader(url, storage_options=opts, **kw)
    dcp.load(state, storage_reader=reader, **no_dist())
    return reader


def versioned(v: float) -> dict[str, Any]:
    return {"a": torch.full((20_000,), v), "b": torch.full((3, 700), v), "v": v}


class SuiteBase:
    """Capability flags and helpers of :class:`~dcp_volumes.testing.suite.CheckpointStoreTests`.

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
        multi_rank_budget_s: how long all the spawned runs of one multi-rank test may take
            together (below pytest's per-test timeout, so that a hung rank fails the test
            with its own message: which run, which rank, which phase).
    """

    multi_process: bool | None = None
    conditional_create: bool | None = None
    retries_visible: bool | None = None
    multipart_listing: bool | None = None
    verifies_upload_checksums: bool = False
    persistent_fault_timeout_s: float = 60.0
    multi_rank_budget_s: float = 270.0

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



class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def write_matcher(store: Store, name_regex: str = "") -> dict[str, Any]:
    """FaultRule fields matching object writes: PUTs on S3 and Azure, uploads on GCS."""
    if store.root.startswith(("gs", "gcs")):
        return {"path_regex": "/upload/" + (f".*{name_regex}" if name_regex else "")}
    return {"method": "PUT", **({"path_regex": name_regex} if name_regex else {})}


def data_write_matcher(store: Store) -> dict[str, Any]:
    """FaultRule fields matching only the requests that carry shard bytes."""
    if store.root.startswith(("gs", "gcs")):
        return {"path_regex": "upload_id="}
    return {"method": "PUT", "path_regex": r"\.distcp"}


def busy_body(store: Store, status: int = 503) -> bytes:
    from dcp_volumes.testing import faultproxy

    if store.root.startswith("s3"):
        return faultproxy.S3_SLOWDOWN_XML if status == 503 else faultproxy.S3_INTERNAL_ERROR_XML
    if store.root.startswith(("gs", "gcs")):
        return faultproxy.GCS_RATE_LIMIT_JSON
    return faultproxy.AZURE_SERVER_BUSY_XML


def shards_complete(fs: fsspec.AbstractFileSystem, root: str) -> bool:
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


def open_multipart_uploads(store: Store, url: str) -> list[str]:
    bucket, _, prefix = store.raw_path(url).partition("/")
    # Behind the writer's back: a separate s3fs instance's own client call.
    resp = store.raw_fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return [u["Key"] for u in resp.get("Uploads", [])]


_ = io
