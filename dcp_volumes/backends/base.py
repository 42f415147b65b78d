"""The backend interface: one resolved checkpoint location and every call made to its store.

A :class:`Backend` owns the filesystem client, the event loop its calls run on, and the one
choke point (:meth:`Backend.call`) through which every request goes: retries of transient
errors with capped exponential backoff and full jitter, pacing by the process's
:class:`~dcp_volumes.backends.pacing.StoreThrottle` for the store once it throttles, and
translation of the final error into :mod:`dcp_volumes.errors`
(:mod:`dcp_volumes.backends.translate`). Each store's module
subclasses it, states its capabilities as class attributes, and overrides the raw calls
that differ from plain fsspec. Nothing outside :mod:`dcp_volumes.backends` branches on
which store it talks to.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, TypeVar

import fsspec.asyn

from dcp_volumes import errors
from dcp_volumes.backends._entries import Entries
from dcp_volumes.backends._ranges import check_read
from dcp_volumes.backends.pacing import StoreThrottle, store_throttle
from dcp_volumes.backends.probe import round_trip_s as measure_round_trip
from dcp_volumes.backends.records import (
    Attempts,
    CallStats,
    ObjectInfo,
    StaleUpload,
    never_retry,
    to_epoch,
)
from dcp_volumes.backends.sink import Sink, StreamSink
from dcp_volumes.backends.translate import (
    is_throttle,
    is_transient,
    redact_url,
    status_and_code,
    throttled_too_long,
    translate_error,
)
from dcp_volumes.backends.versions import VersionedReads
from dcp_volumes.config import RetryOptions

__all__ = [
    "THROTTLES_PER_ATTEMPT",
    "THROTTLE_RETRY_DOUBLINGS",
    "Backend",
    "CallStats",
    "ObjectInfo",
    "StaleUpload",
    "never_retry",
    "to_epoch",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: with the reaction to throttling on, a throttled request's backoff stops doubling after
#: this many doublings (still drawn with full jitter): the store's pacer is what slows down
THROTTLE_RETRY_DOUBLINGS = 1
#: with the reaction on, this many throttle answers spend one of ``max_attempts``, while the
#: store answers other requests of the process (it is rate-limiting, not down): the pacer
#: keeps such retries from adding load, and quick retries must not use up a request's
#: attempts within the first second of a throttling storm (``deadline_s`` still bounds them).
#: A store that refuses every request since this one started gets whole attempts: a dead
#: store fails a save as fast with the reaction on as without it
THROTTLES_PER_ATTEMPT = 4


class Backend(VersionedReads, Entries):
    """A resolved checkpoint location: filesystem, root path, retry policy and capabilities.

    Backends hold live clients and are never pickled; writers and readers create them
    lazily from their (picklable) URL and options (:mod:`dcp_volumes._location`).

    Capabilities (class attributes, read by the conformance suite and the catalog):
        object_store: a bucket-based store; the URL must name a path inside a bucket.
        conditional_create: ``.metadata`` can be created exclusively (of two racing saves,
            exactly one commits).
        shared_across_processes: other processes (ranks, async_save workers) see the store.
        retries_visible: transient errors reach our retry loop (and so the figures); False
            where the client retries inside its own streaming writer.
        lists_stale_uploads: unfinished multipart uploads can be listed and aborted.
        sends_part_checksums: every upload request carries the part's CRC32C, which the
            store may verify.
        has_directories: real directories that outlive their files (pruned after deletes).
        local_paths: the root is a path on this machine (links, FIFOs, visible partial
            files; :class:`~dcp_volumes.backends._entries.Entries`).
    """

    name: ClassVar[str] = "fsspec"
    #: the ``pip install dcp-volumes[extra]`` that brings this store's filesystem
    extra: ClassVar[str] = "all"
    object_store: ClassVar[bool] = False
    conditional_create: ClassVar[bool] = True
    shared_across_processes: ClassVar[bool] = True
    retries_visible: ClassVar[bool] = True
    lists_stale_uploads: ClassVar[bool] = False
    sends_part_checksums: ClassVar[bool] = False
    has_directories: ClassVar[bool] = False

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None,
                 retry: RetryOptions, *, pacing: bool = True) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
        self.retry = retry
        opts = self.client_options(dict(storage_options or {}))
        try:
            fs, root = fsspec.url_to_fs(url, **opts)
        except ImportError as exc:
            raise errors.ConfigError(
                f"the filesystem for {redact_url(url)} is not installed: "
                f"pip install 'dcp-volumes[{self.extra}]'"
            ) from exc
        except ValueError as exc:
            raise errors.ConfigError(
                f"cannot open {redact_url(url)}: {type(exc).__name__}; "
                "use a URL like s3://bucket/path, gs://, az://, file:// or memory://"
            ) from exc
        except OSError as exc:  # a filesystem that connects on construction (ftp, sftp, ...)
            raise errors.ConfigError(
                f"cannot reach the store of {redact_url(url)} ({type(exc).__name__}): check the "
                "host name in the URL and the network"
            ) from exc
        self.fs = fs
        self.root = self.normalize_root(root)
        if self.object_store and (not self.root or "/" not in self.root.strip("/")):
            raise errors.ConfigError(
                f"{redact_url(url)} names no path inside the bucket: "
                f"use a URL like {self.scheme}://bucket/run/step-100"
            )
        self.is_async = bool(getattr(fs, "async_impl", False))
        self.loop = fs.loop if self.is_async else fsspec.asyn.get_loop()
        endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get(
            "endpoint_url") or opts.get("account_name") or ""
        #: (scheme, endpoint, bucket): what one :class:`StoreThrottle` is shared over
        self.store_key: tuple[str, ...] = (self.scheme, str(endpoint), self.bucket)
        #: this process's pacing for the store; ``None`` (``pacing=False``): no reaction to
        #: throttling but retries (``TransferOptions(throttle_backoff=False)``)
        self.throttle: StoreThrottle | None = store_throttle(self.store_key) if pacing else None

    # ---- configuration hooks -----------------------------------------------------------
    @classmethod
    def client_options(cls, opts: dict[str, Any]) -> dict[str, Any]:
        """The fsspec options to open the filesystem with (defaults added to the user's)."""
        return opts

    @classmethod
    def cli_options(cls, *, endpoint: str | None, anon: bool, url: str) -> dict[str, Any]:
        """fsspec options for the CLI's ``--endpoint-url`` / ``--anon`` flags."""
        if endpoint:
            raise errors.ConfigError(
                f"--endpoint-url does not apply to {redact_url(url)!r}: it is for s3://, gs:// "
                "and az:// URLs"
            )
        if anon:
            raise errors.ConfigError(f"--anon does not apply to {redact_url(url)!r}")
        return {}

    def normalize_root(self, root: str) -> str:
        return root.rstrip("/")

    # ---- paths -------------------------------------------------------------------------
    def path(self, relative: str) -> str:
        """Backend path (no scheme) of an object under the checkpoint root."""
        return f"{self.root}/{relative}"

    def object_url(self, relative: str) -> str:
        return f"{self.url}/{relative}"

    @property
    def bucket(self) -> str:
        """The bucket/container of an object store (the root's first component)."""
        return self.root.split("/", 1)[0]

    # ---- the sync/async bridge ---------------------------------------------------------
    def run(self, coro_fn: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``coro_fn()`` on this backend's event loop and wait for it."""
        return fsspec.asyn.sync(self.loop, coro_fn, timeout=timeout)  # type: ignore[no-any-return]

    async def fs_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a filesystem method, async if the filesystem is, else in a worker thread."""
        if self.is_async:
            return await getattr(self.fs, "_" + name)(*args, **kwargs)
        return await asyncio.to_thread(getattr(self.fs, name), *args, **kwargs)

    # ---- the choke point ---------------------------------------------------------------
    async def call(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        op: str,
        url: str,
        stats: CallStats | None = None,
        retry_if: Callable[[BaseException], bool] = is_transient,
    ) -> T:
        """Await ``fn()`` with retries on transient errors; translate the final error.

        Every attempt first takes its turn at the store's :attr:`throttle` (no wait until the
        store has throttled this process), and reports back: a throttle answer (SlowDown,
        429, 503: :func:`~dcp_volumes.backends.translate.is_throttle`) cuts the process's
        rate to the store, answers recover it. The backoff before a retry keeps full jitter;
        for a throttle answer, while the pacer is on, it stops doubling after
        :data:`THROTTLE_RETRY_DOUBLINGS` (the pacer does the slowing down), and, while the
        store still answers other requests of the process, it spends only
        ``1 / THROTTLES_PER_ATTEMPT`` of ``max_attempts`` (the deadline still bounds it).
        A transfer (the calls sharing ``stats``) that gets only throttles for longer than
        ``deadline_s`` fails at its next throttle answer: in about one deadline, not one
        per part."""
        tries = Attempts(start=time.monotonic())
        while True:
            tries.attempt += 1
            tries.started = await self.throttle.turn() if self.throttle is not None else 0.0
            if tries.first_started is None:
                tries.first_started = tries.started
            try:
                result = await self._attempt(fn, tries.start)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — retried, or translated and raised
                await self._after_failure(exc, tries, op=op, url=url, stats=stats,
                                          retry_if=retry_if)
                continue
            if self.throttle is not None:
                self.throttle.on_success(tries.started)
            if stats is not None:
                stats.add(requests=1)
                stats.note_answer()
            return result

    async def _attempt(self, fn: Callable[[], Awaitable[T]], start: float) -> T:
        """One attempt; the deadline bounds the request end to end, a hung attempt included."""
        if self.retry.deadline_s is None:
            return await fn()
        remaining = self.retry.deadline_s - (time.monotonic() - start)
        return await asyncio.wait_for(fn(), timeout=max(remaining, 0.001))

    async def _after_failure(self, exc: Exception, tries: Attempts, *, op: str, url: str,
                             stats: CallStats | None,
                             retry_if: Callable[[BaseException], bool]) -> None:
        """Account for a failed attempt: raise the translated error when it was the last
        one, else log the retry and sleep its backoff."""
        policy, throttle = self.retry, self.throttle
        throttled = is_throttle(exc)
        paced = throttled and throttle is not None and policy.max_attempts > 1
        if throttled:
            tries.throttles += 1
            if throttle is not None:
                throttle.on_throttle(tries.started)
        # a fraction of an attempt only while the store serves others (rate-limiting);
        # a store that refused everything since this request started is down
        cheap = (paced and throttle is not None and tries.first_started is not None
                 and throttle.answered_since(tries.first_started))
        tries.spent += 1.0 / THROTTLES_PER_ATTEMPT if cheap else 1.0
        elapsed = time.monotonic() - tries.start
        if throttled and stats is not None and retry_if(exc):
            self._check_throttle_streak(exc, stats, op=op, url=url)
        if (
            not retry_if(exc)
            or tries.spent >= policy.max_attempts
            or (policy.deadline_s is not None and elapsed >= policy.deadline_s)
        ):
            logger.debug("%s %s failed on attempt %d: %s", op, redact_url(url), tries.attempt,
                         type(exc).__name__)
            streak = stats.throttle_streak(time.monotonic()) if stats is not None else None
            if streak is not None and tries.throttles:  # it ends a run of throttles
                raise throttled_too_long(exc, url=url, op=op, answers=streak[0],
                                         seconds=streak[1], deadline_s=policy.deadline_s) from exc
            raise translate_error(exc, url=url, op=op) from exc
        delay = self._backoff_s(tries.attempt, paced=paced, elapsed=elapsed)
        status, code = status_and_code(exc)
        logger.warning(
            "%s %s: transient %s, retry %d (%.2f of %d attempts spent) in %.2fs%s",
            op, redact_url(url), code or (f"HTTP {status}" if status else type(exc).__name__),
            tries.attempt, tries.spent, policy.max_attempts, delay, ", paced" if paced else "",
        )
        if stats is not None:
            stats.add(retries=1, requests=1, throttled=int(throttled))
        await asyncio.sleep(delay)

    def _check_throttle_streak(self, exc: Exception, stats: CallStats, *, op: str,
                               url: str) -> None:
        """Fail the transfer once its throttle answers in a row outlast the deadline."""
        answers, seconds = stats.note_throttle(time.monotonic())
        deadline = self.retry.deadline_s
        if deadline is not None and seconds >= deadline:
            logger.debug("%s %s: %d throttle answers in a row over %.1fs", op, redact_url(url),
                         answers, seconds)
            raise throttled_too_long(exc, url=url, op=op, answers=answers, seconds=seconds,
                                     deadline_s=deadline) from exc

    def _backoff_s(self, attempt: int, *, paced: bool, elapsed: float) -> float:
        """The sleep before retry number ``attempt``: capped exponential, full jitter."""
        policy = self.retry
        doublings = attempt - 1
        if paced:
            # The pacer has slowed the whole process down already; a retry that also
            # backed off exponentially would sit out the capacity the pacing allows.
            doublings = min(doublings, THROTTLE_RETRY_DOUBLINGS)
        backoff = min(policy.max_backoff_s, policy.initial_backoff_s * 2**doublings)
        delay = random.uniform(0, backoff) if policy.jitter else backoff
        if policy.deadline_s is not None:
            delay = min(delay, max(0.0, policy.deadline_s - elapsed))
        return delay

    # ---- latency probe -----------------------------------------------------------------
    async def _ping(self) -> Any:
        """One cheap request to the store; ``None``-returning stores have no probe."""
        return None

    has_probe: ClassVar[bool] = False

    async def round_trip_s(self, samples: int = 3) -> float | None:
        """The fastest of ``samples`` cheap requests to the store, in seconds, measured once
        per process and store (:mod:`~dcp_volumes.backends.probe`); ``None`` where the store
        has no probe or one fails (a probe never fails a save)."""
        if not self.has_probe:
            return None
        return await measure_round_trip(self._ping, self.store_key, samples)

    # ---- raw single-attempt operations (overridden per store) ---------------------------
    async def _get(self, relative: str, start: int | None, end: int | None) -> bytes:
        data: bytes = await self.fs_call("cat_file", self.path(relative), start=start, end=end)
        check_read(self.object_url(relative), start, end, len(data))
        return data

    async def _put(self, relative: str, data: bytes, *, exclusive: bool) -> None:
        extra: dict[str, Any] = {"mode": "create"} if exclusive else {}
        await self.fs_call("pipe_file", self.path(relative), data, **extra)

    async def _commit_once(self, relative: str, data: bytes, *, exclusive: bool,
                           save_id: str) -> None:
        """One attempt at writing ``relative`` atomically (conditional create if
        ``exclusive``); a refused create raises something translated to
        :class:`~dcp_volumes.errors.CheckpointExistsError`."""
        await self._put(relative, data, exclusive=exclusive)

    # ---- small object operations -------------------------------------------------------
    async def cat(self, relative: str, *, op: str = "download", stats: CallStats | None = None,
                  start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object (all of it by default)."""
        return await self.call(lambda: self._get(relative, start, end), op=op,
                               url=self.object_url(relative), stats=stats)

    async def put(self, relative: str, data: bytes, *, stats: CallStats | None = None,
                  exclusive: bool = False) -> None:
        """Write a small object in one request (conditional create when ``exclusive``)."""
        await self.call(lambda: self._put(relative, data, exclusive=exclusive), op="upload",
                        url=self.object_url(relative), stats=stats)

    async def commit(self, relative: str, data: bytes, *, exclusive: bool, save_id: str,
                     stats: CallStats | None = None) -> None:
        """Write ``relative`` in one atomic operation, retried through the choke point."""
        await self.call(
            lambda: self._commit_once(relative, data, exclusive=exclusive, save_id=save_id),
            op="commit", url=self.object_url(relative), stats=stats,
        )

    async def info(self, relative: str, *, stats: CallStats | None = None
                   ) -> dict[str, Any] | None:
        """The object's fsspec info (``size``, ``type``, ...), ``None`` when it is absent."""
        path = self.path(relative)
        self.fs.invalidate_cache(path)  # other processes write here: never trust a cache
        try:
            return await self.call(lambda: self.fs_call("info", path), op="read",  # type: ignore[no-any-return]
                                   url=self.object_url(relative), stats=stats)
        except errors.ObjectNotFoundError:
            return None

    async def exists(self, relative: str) -> bool:
        return await self.info(relative) is not None

    async def size(self, relative: str, *, stats: CallStats | None = None) -> int | None:
        """The object's size in bytes, ``None`` when it is absent."""
        info = await self.info(relative, stats=stats)
        return None if info is None else int(info.get("size") or 0)

    async def list_names(self) -> list[str]:
        """Names of the objects directly under the root (empty when the root is absent)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = await self.call(lambda: self.fs_call("ls", self.root, detail=False),
                                      op="list", url=self.url)
        except errors.ObjectNotFoundError:
            return []
        prefix = self.root.rstrip("/") + "/"
        names = []
        for entry in entries:
            entry = str(entry)
            name = entry[len(prefix):] if entry.startswith(prefix) else entry.rsplit("/", 1)[-1]
            if name and name != self.root:
                names.append(name)
        return names

    #: listing fields that carry an object's modification time, in order of preference
    mtime_fields: ClassVar[tuple[str, ...]] = ("mtime", "LastModified", "last_modified",
                                               "updated", "created")

    def mtime_of(self, info: dict[str, Any]) -> float | None:
        for key in self.mtime_fields:
            if key in info:
                t = to_epoch(info[key])
                if t is not None:
                    return t
        return None

    async def scan(self) -> list[ObjectInfo]:
        """Every object under the root, recursively, in one listing.

        An empty listing of an object store checks that the bucket exists.
        """
        self.fs.invalidate_cache(self.root)
        try:
            found = await self.call(lambda: self.fs_call("find", self.root, detail=True),
                                    op="list", url=self.url)
        except errors.ObjectNotFoundError:
            found = {}
        prefix = self.root.rstrip("/") + "/"
        out: list[ObjectInfo] = []
        for path, info in dict(found).items():
            path = str(path)
            if not path.startswith(prefix) or info.get("type", "file") != "file":
                continue
            rel = path[len(prefix):]
            if rel and not rel.endswith("/"):
                out.append(ObjectInfo(rel, int(info.get("size") or 0), self.mtime_of(info)))
        if not out and self.object_store:
            await self.check_bucket()  # an empty prefix is fine, a missing bucket is not
        return out

    async def remove(self, relatives: list[str]) -> None:
        """Delete objects (missing ones are fine). Raises only on real failures (DeleteError
        unless a more specific error fits), once no request is left in flight."""
        if not relatives:
            return

        async def _rm_one(rel: str) -> None:
            p = self.path(rel)
            try:
                await self.call(lambda: self.fs_call("rm_file", p), op="delete",
                                url=self.object_url(rel))
            except errors.ObjectNotFoundError:
                pass

        outcomes = await asyncio.gather(*(_rm_one(r) for r in relatives), return_exceptions=True)
        self.fs.invalidate_cache(self.root)
        for failed in [o for o in outcomes if isinstance(o, BaseException)][:1]:
            raise failed

    async def prune_empty_dirs(self, relative: str = "") -> None:
        """Remove directories left empty under ``relative`` (stores with real directories)."""

    # ---- uploads -----------------------------------------------------------------------
    def make_sink(self, relative: str, stats: CallStats, part_size: int) -> Sink:
        """The sink that makes one shard file durable, part by part."""
        return StreamSink(self, relative, stats, part_size)

    async def stale_uploads(self, older_than_s: float, now: float) -> list[StaleUpload]:
        """Unfinished multipart uploads under the root initiated ``older_than_s`` ago."""
        return []

    async def abort_upload(self, upload: StaleUpload) -> None:
        """Abort one of :meth:`stale_uploads` (gone meanwhile is fine)."""
        raise errors.DCPVolumesError(f"{self.name} has no multipart uploads to abort")
