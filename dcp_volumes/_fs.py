"""URL → filesystem, per-backend capabilities, and the one place backend errors are translated.

Every backend call made by dcp_volumes goes through :meth:`Backend.call`, which retries
transient failures with capped exponential backoff and jitter and turns whatever the
backend raised into the :mod:`dcp_volumes.errors` hierarchy (``raise ... from exc``).
Error classification looks at exception types, HTTP status codes and service error codes,
never at message strings.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import logging
import os
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import crc32c
import fsspec
import fsspec.asyn

from dcp_volumes import errors
from dcp_volumes.config import RetryOptions

__all__ = ["Backend", "is_transient", "open_backend", "redact_url", "translate_error"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Scheme → (fsspec protocol, kind). "kind" selects the upload sink and the commit primitive.
_SCHEMES: dict[str, str] = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "file": "local",
    "local": "local",
    "memory": "memory",
}

# Service error codes (S3 ``Error.Code``) that mean "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
        "OperationAborted",
        "ServerBusy",
        "BadDigest",  # the body did not match its checksum in transit: resend it
        "OperationTimedOut",
    }
)
_PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "InvalidToken",
        "ExpiredToken",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
    }
)
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "404", "NotFound", "BlobNotFound", "NoSuchUpload"})
_PRECONDITION_CODES = frozenset(
    {"PreconditionFailed", "ConditionNotMet", "BlobAlreadyExists", "ConditionalRequestConflict"}
)


def redact_url(url: str) -> str:
    """Drop any ``user:password@`` part of a URL so it can be logged."""
    return re.sub(r"(?<=://)[^/@]*@", "***@", url)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps (filesystems re-raise client errors as builtins)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """(HTTP status, service error code) of the first exception in the chain that has one."""
    for e in _chain(exc):
        status, code = _own_status_and_code(e)
        if status is not None or code is not None:
            return status, code
    return None, None


def _own_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        err = response.get("Error", {}) or {}
        meta = response.get("ResponseMetadata", {}) or {}
        status = meta.get("HTTPStatusCode")
        code = err.get("Code")
        return (int(status) if status is not None else None), (str(code) if code else None)
    # azure.core.exceptions.HttpResponseError
    status_code = getattr(exc, "status_code", None)
    if isinstance(status_code, int):
        code = getattr(exc, "error_code", None)
        return status_code, (str(code) if code else None)
    # gcsfs.retry.HttpError, aiohttp.ClientResponseError
    for attr in ("code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value, None
    return None, None


def _is_connection_error(exc: BaseException) -> bool:
    return any(_own_connection_error(e) for e in _chain(exc))


def _own_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    # botocore / aiohttp / urllib3 / azure connection-level failures, matched by type name
    # so that none of those packages needs to be importable here.
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "ResponseStreamingError",
            "IncompleteReadError",
            "ClientConnectionError",
            "ClientPayloadError",
            "ServerDisconnectedError",
            "ServerTimeoutError",
            "ClientOSError",
            "ServiceRequestError",
            "ServiceResponseError",
            "IncompleteRead",
            "ProtocolError",
        }
    )


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same request later may succeed."""
    if isinstance(exc, errors.DCPVolumesError):
        return False
    if _is_connection_error(exc):
        return True
    status, code = _status_and_code(exc)
    if code in _TRANSIENT_CODES:
        return True
    if status is not None and (status == 429 or status == 408 or status >= 500):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ETIMEDOUT,
                                                        errno.EPIPE)


def translate_error(exc: BaseException, *, url: str, op: str) -> errors.DCPVolumesError:
    """Map a backend exception onto the dcp_volumes hierarchy.

    Args:
        exc: what the backend raised.
        url: the object or checkpoint URL concerned (credentials are stripped).
        op: what we were doing, e.g. ``"upload"``, ``"download"``, ``"commit"``, ``"list"``.
    """
    if isinstance(exc, errors.DCPVolumesError):
        return exc
    where = redact_url(url)
    status, code = _status_and_code(exc)
    kind = type(exc).__name__
    if code in _PERMISSION_CODES or status in (401, 403) or isinstance(exc, PermissionError):
        return errors.StoragePermissionError(
            f"{op} of {where} was refused ({code or status or kind}): check the credentials "
            "in storage_options or the environment and the bucket's access policy"
        )
    if code in _MISSING_BUCKET_CODES:
        return errors.BucketNotFoundError(
            f"{op} of {where} failed: the bucket/container does not exist; create it or fix the URL"
        )
    if code in _PRECONDITION_CODES or status == 412 or isinstance(exc, FileExistsError):
        return errors.CheckpointExistsError(
            f"{where} already exists (conditional write refused): another save committed first"
        )
    if code == "InvalidRange" or status == 416:
        return errors.IntegrityError(
            f"{op} of {where} asked for bytes past the end of the object: it is truncated"
        )
    if code in _MISSING_KEY_CODES or status == 404 or isinstance(exc, FileNotFoundError):
        return errors.ObjectNotFoundError(f"{op} of {where} failed: object not found")
    if is_transient(exc):
        detail = code or (f"HTTP {status}" if status else kind)
        cls = errors.DownloadError if op in ("download", "list", "read") else errors.UploadError
        return cls(f"{op} of {where} failed after retries ({detail}); the store is unavailable "
                   "or throttling: retry later or raise RetryOptions.max_attempts")
    detail = code or (f"HTTP {status}" if status else kind)
    if op in ("download", "list", "read"):
        return errors.DownloadError(f"{op} of {where} failed ({detail})")
    return errors.UploadError(f"{op} of {where} failed ({detail})")


def s3_checksum(data: bytes | bytearray | memoryview, crc: int | None = None) -> dict[str, str]:
    """The ``ChecksumCRC32C`` argument of an S3 PUT of ``data`` (``crc`` if already known)."""
    value = crc32c.crc32c(data) if crc is None else crc
    return {"ChecksumCRC32C": base64.b64encode(value.to_bytes(4, "big")).decode("ascii")}


@dataclass
class CallStats:
    """Counters shared by every call of one save or load."""

    retries: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, *, retries: int = 0, requests: int = 0) -> None:
        with self._lock:
            self.retries += retries
            self.requests += requests


class Backend:
    """A resolved checkpoint location: filesystem, root path, kind and retry policy.

    Backends hold live clients and are never pickled; writers and readers create them
    lazily from their (picklable) URL and options.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None,
        retry: RetryOptions,
    ) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.retry = retry
        opts = dict(storage_options or {})
        scheme, kind = _parse_scheme(url)
        self.kind = kind
        self.scheme = scheme
        if kind == "s3":
            config = dict(opts.get("config_kwargs") or {})
            # Our own retry loop is the only one: botocore's would multiply attempts.
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            # Enough pooled connections for every request we put in flight (default 10).
            config.setdefault("max_pool_connections", 64)
            # Every item carries our own end-to-end CRC32C, verified on load; botocore's
            # per-request CRC32 would cost ~a third of the upload CPU on top.
            config.setdefault("request_checksum_calculation", "when_required")
            config.setdefault("response_checksum_validation", "when_required")
            # On http:// endpoints botocore would SHA-256 every request body on the event
            # loop to sign it (~1 CPU-s per GiB, and as much again on the server). Every
            # PUT we make carries a CRC32C header instead (s3_checksum), which the store
            # verifies, as AWS SDKs do by default; headers stay signed.
            s3_config = dict(config.get("s3") or {})
            s3_config.setdefault("payload_signing_enabled", False)
            config["s3"] = s3_config
            opts["config_kwargs"] = config
        try:
            fs, root = fsspec.url_to_fs(url, **opts)
        except (ImportError, ValueError) as exc:
            if isinstance(exc, ImportError):
                extra = {"s3": "s3", "gcs": "gcs", "azure": "azure"}.get(kind, "all")
                raise errors.ConfigError(
                    f"the filesystem for {redact_url(url)} is not installed: "
                    f"pip install 'dcp-volumes[{extra}]'"
                ) from exc
            raise errors.ConfigError(
                f"cannot open {redact_url(url)}: {type(exc).__name__}; "
                "use a URL like s3://bucket/path, gs://, az://, file:// or memory://"
            ) from exc
        self.fs = fs
        self.root = root.rstrip("/") if kind != "local" else os.path.abspath(root)
        if kind in ("s3", "gcs", "azure") and (not self.root or "/" not in self.root.strip("/")):
            raise errors.ConfigError(
                f"{redact_url(url)} names no path inside the bucket: "
                "use a URL like s3://bucket/run/step-100"
            )
        self.is_async = bool(getattr(fs, "async_impl", False))
        self.loop = fs.loop if self.is_async else fsspec.asyn.get_loop()

    # ---- paths -------------------------------------------------------------------------
    def path(self, relative: str) -> str:
        """Backend path (no scheme) of an object under the checkpoint root."""
        return f"{self.root}/{relative}"

    def object_url(self, relative: str) -> str:
        return f"{self.url}/{relative}"

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
        """Await ``fn()`` with retries on transient errors; translate the final error."""
        policy = self.retry
        attempt = 0
        start = time.monotonic()
        while True:
            attempt += 1
            try:
                result = await fn()
                if stats is not None:
                    stats.add(requests=1)
                return result
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                elapsed = time.monotonic() - start
                if (
                    not retry_if(exc)
                    or attempt >= policy.max_attempts
                    or (policy.deadline_s is not None and elapsed >= policy.deadline_s)
                ):
                    logger.debug("%s %s failed on attempt %d: %s", op, redact_url(url), attempt,
                                 type(exc).__name__)
                    raise translate_error(exc, url=url, op=op) from exc
                backoff = min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** (attempt - 1))
                delay = random.uniform(0, backoff) if policy.jitter else backoff
                status, code = _status_and_code(exc)
                logger.warning(
                    "%s %s: transient %s, retry %d/%d in %.2fs", op, redact_url(url),
                    code or (f"HTTP {status}" if status else type(exc).__name__),
                    attempt, policy.max_attempts - 1, delay,
                )
                if stats is not None:
                    stats.add(retries=1, requests=1)
                await asyncio.sleep(delay)

    async def round_trip_s(self, samples: int = 3) -> float | None:
        """The fastest of ``samples`` cheap requests to the store (S3 ``HeadBucket``, Azure
        container properties), in seconds; ``None`` for other backends or when one fails
        (a probe never fails a save)."""
        if self.kind == "s3":
            s3 = await self.fs.set_session()
            bucket = self.root.split("/", 1)[0]
            request: Callable[[], Awaitable[Any]] = lambda: s3.head_bucket(Bucket=bucket)
        elif self.kind == "azure":
            container = self.fs.service_client.get_container_client(self.root.split("/", 1)[0])
            request = lambda: container.get_container_properties(retry_total=0)
        else:
            return None
        best = float("inf")
        for _ in range(samples):
            started = time.monotonic()
            try:
                await request()
            except Exception:  # noqa: BLE001 — only a hint; the save's own requests report errors
                return None
            best = min(best, time.monotonic() - started)
        return best

    # ---- small object operations -------------------------------------------------------
    def azure_blob(self, relative: str) -> Any:
        """An async Azure ``BlobClient`` for an object under the root (Azure only)."""
        container, blob, _ = self.fs.split_path(self.path(relative))
        return self.fs.service_client.get_blob_client(container=container, blob=blob)

    async def cat(self, relative: str, *, op: str = "download", stats: CallStats | None = None,
                  start: int | None = None, end: int | None = None) -> bytes:
        path = self.path(relative)
        if self.kind == "azure":
            # retry_total=0: our loop retries (the SDK's first retry waits ~15 s).
            async def _azure_get() -> bytes:
                length = None if end is None else end - (start or 0)
                stream = await self.azure_blob(relative).download_blob(
                    offset=start, length=length, retry_total=0)
                return await stream.readall()  # type: ignore[no-any-return]
            return await self.call(_azure_get, op=op, url=self.object_url(relative), stats=stats)
        return await self.call(
            lambda: self.fs_call("cat_file", path, start=start, end=end),
            op=op, url=self.object_url(relative), stats=stats,
        )

    async def put(self, relative: str, data: bytes, *, stats: CallStats | None = None,
                  exclusive: bool = False) -> None:
        """Write a small object in one request (conditional create when ``exclusive``)."""
        path = self.path(relative)
        if self.kind == "azure":
            fn: Callable[[], Awaitable[Any]] = lambda: self.azure_blob(relative).upload_blob(
                data, overwrite=not exclusive, retry_total=0)
        else:
            extra: dict[str, Any] = {}
            if self.kind == "s3":
                # One PutObject whatever the size (s3fs would go multipart past 2 chunks,
                # where a whole-object checksum is not a valid argument).
                extra = {**s3_checksum(data), "chunksize": max(len(data), 50 << 20)}
            if exclusive:
                extra["mode"] = "create"
            fn = lambda: self.fs_call("pipe_file", path, data, **extra)
        if self.kind == "local":
            os.makedirs(self.root, exist_ok=True)
        await self.call(fn, op="upload", url=self.object_url(relative), stats=stats)

    async def exists(self, relative: str) -> bool:
        path = self.path(relative)
        self.fs.invalidate_cache(path)  # other processes write here: never trust a listing cache
        try:
            await self.call(lambda: self.fs_call("info", path), op="read",
                            url=self.object_url(relative))
        except errors.ObjectNotFoundError:
            return False
        return True

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

    async def remove(self, relatives: list[str]) -> None:
        """Delete objects (missing ones are fine). Raises only on real failures."""
        if not relatives:
            return
        paths = [self.path(r) for r in relatives]

        async def _rm_one(p: str, rel: str) -> None:
            try:
                await self.call(lambda: self.fs_call("rm_file", p), op="delete",
                                url=self.object_url(rel))
            except errors.ObjectNotFoundError:
                pass

        await asyncio.gather(*(_rm_one(p, r) for p, r in zip(paths, relatives)))
        self.fs.invalidate_cache(self.root)

    async def check_bucket(self) -> None:
        """Fail fast (before any byte moves) on a missing bucket, refused credentials, or a
        checkpoint path that is an existing file/object."""
        if self.kind in ("s3", "gcs", "azure"):
            bucket = self.root.split("/", 1)[0]
            try:
                await self.call(lambda: self.fs_call("ls", self.root, detail=False), op="list",
                                url=self.url)
            except errors.ObjectNotFoundError:
                # An empty prefix is fine; the bucket itself must exist.
                self.fs.invalidate_cache(bucket)
                if not await self.call(lambda: self.fs_call("exists", bucket), op="list",
                                       url=self.url):
                    raise errors.BucketNotFoundError(
                        f"bucket/container {bucket!r} of {redact_url(self.url)} does not exist: "
                        "create it or fix the URL"
                    ) from None
        try:
            info = await self.call(lambda: self.fs_call("info", self.root), op="list",
                                   url=self.url)
        except errors.ObjectNotFoundError:
            return
        if info.get("type") == "file":
            raise errors.ConfigError(
                f"{redact_url(self.url)} is a file/object, not a directory: choose a "
                "directory-like path"
            )


def _parse_scheme(url: str) -> tuple[str, str]:
    if not isinstance(url, (str, os.PathLike)):
        raise errors.ConfigError(f"checkpoint URL must be a string or path, got {type(url).__name__}")
    url = os.fspath(url)
    if not url:
        raise errors.ConfigError("checkpoint URL is empty: pass e.g. s3://bucket/run/step-100")
    if "://" not in url:
        return "file", "local"
    scheme = url.split("://", 1)[0].lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise errors.ConfigError(f"malformed checkpoint URL {redact_url(url)!r}")
    kind = _SCHEMES.get(scheme)
    if kind is None:
        try:
            fsspec.get_filesystem_class(scheme)
        except (ValueError, ImportError) as exc:
            raise errors.ConfigError(
                f"unknown URL scheme {scheme!r} in {redact_url(url)!r}: use s3://, gs://, az://, "
                "abfs://, file:// or memory:// (or any installed fsspec protocol)"
            ) from exc
        kind = "other"
    rest = url.split("://", 1)[1]
    if kind in ("s3", "gcs", "azure") and (not rest or rest.startswith("/")):
        raise errors.ConfigError(
            f"malformed checkpoint URL {redact_url(url)!r}: expected {scheme}://bucket/path"
        )
    return scheme, kind


def open_backend(url: str, storage_options: dict[str, Any] | None, retry: RetryOptions) -> Backend:
    """Resolve ``url`` into a :class:`Backend` (validating it)."""
    return Backend(url, storage_options, retry)


class Location:
    """A checkpoint URL, its fsspec options and retry policy, and a lazily opened Backend.

    The shared part of ``VolumeWriter`` and ``VolumeReader``: it validates the URL on
    construction and pickles as configuration only (no live client, loop or thread), so a
    writer can cross into ``AsyncCheckpointerType.PROCESS``'s worker process.
    """

    def _init_location(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None,
                       retry: RetryOptions | None) -> None:
        self._url = os.fspath(path)
        _parse_scheme(self._url)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise errors.ConfigError("storage_options must be a dict of fsspec options or None")
        if retry is not None and not isinstance(retry, RetryOptions):
            raise errors.ConfigError(f"retry= must be a RetryOptions, got {type(retry).__name__}")
        self._storage_options = dict(storage_options or {})
        self.retry = retry or RetryOptions()
        self._backend_obj: Backend | None = None

    @property
    def url(self) -> str:
        """The checkpoint URL."""
        return self._url

    @property
    def checkpoint_id(self) -> str:
        return self._url

    def _backend(self) -> Backend:
        if self._backend_obj is None:
            self._backend_obj = open_backend(self._url, self._storage_options, self.retry)
        return self._backend_obj

    def _switch_url(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """DCP's ``reset(checkpoint_id)``: point at another checkpoint (validated)."""
        if checkpoint_id is not None:
            url = os.fspath(checkpoint_id)
            _parse_scheme(url)
            if url != self._url:
                self._url = url
                self._backend_obj = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_backend_obj"] = None
        return state

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            _parse_scheme(os.fspath(checkpoint_id))
        except errors.DCPVolumesError:
            return False
        return True
