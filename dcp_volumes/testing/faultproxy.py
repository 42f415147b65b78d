"""A fault-injecting HTTP/1.1 reverse proxy for local object-store servers.

:class:`FaultProxy` listens on 127.0.0.1 (a free port) and forwards every request to one
upstream server (SeaweedFS, moto, fake-gcs-server, Azurite, ...). Clients use
``proxy.endpoint_url`` as their endpoint. The ``Host`` header is forwarded exactly as the client
sent it, so AWS SigV4 signatures (which cover ``Host``) stay valid; ``Location`` response headers
that point at the upstream are rewritten to point at the proxy (fake-gcs-server's resumable
uploads use them).

Per test it can be given :class:`FaultRule` s::

    with FaultProxy(server) as proxy:
        fs = fsspec.filesystem("s3", **proxy.storage_options())
        rule = proxy.add_rule(s3_slowdown(method="PUT", path_regex=r"partNumber=", times=3))
        ...
        assert proxy.stats.rule(rule).injected == 3

Actions (one per request: the first rule that matches and still has injections left wins):

``status``            read the request, answer with ``status``/``body``/``headers`` (the upstream
                      never sees it); the connection stays usable.
``reset``             read the request, then close the connection with a TCP RST, no response.
``delay``             sleep ``delay_s``, then forward.
``truncate``          forward, send the response head and only ``nbytes`` of the body (default:
                      half the ``Content-Length``), then close.
``fail_after_bytes``  forward the head and ``nbytes`` bytes of the request body (as on the wire,
                      chunk framing included), then close with a TCP RST.
``corrupt``           forward the request with one byte of its body flipped (the byte at
                      payload offset ``nbytes``, default the middle of the body), as a bad NIC or
                      middlebox would; the upstream's answer goes back as it is.

A :class:`NetworkProfile` (for benchmarks) adds a first-byte delay to every response and caps
each connection's bandwidth with a token bucket, separately in each direction. Both are off by
default; with the profile off the proxy only copies 1 MiB buffers and is not the bottleneck at
~100 MB/s.

``Expect: 100-continue`` is answered by the proxy itself (and stripped upstream), so that
rules can read the whole request body before deciding what to do.

The proxy runs an asyncio loop in a daemon thread; all public methods are thread-safe.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import http
import logging
import re
import socket
import struct
import threading
import time
import urllib.parse
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from typing_extensions import Self

    from dcp_volumes.testing.servers import LocalServer

__all__ = [
    "AZURE_SERVER_BUSY_XML",
    "GCS_RATE_LIMIT_JSON",
    "S3_INTERNAL_ERROR_XML",
    "S3_SLOWDOWN_XML",
    "FaultAction",
    "FaultProxy",
    "FaultRule",
    "NetworkProfile",
    "ProxyStats",
    "RuleStats",
    "azure_throttled",
    "gcs_rate_limited",
    "s3_internal_error",
    "s3_slowdown",
]

logger = logging.getLogger(__name__)

FaultAction = Literal["status", "reset", "delay", "truncate", "fail_after_bytes", "corrupt"]
_ACTIONS: frozenset[str] = frozenset(
    ("status", "reset", "delay", "truncate", "fail_after_bytes", "corrupt")
)

S3_SLOWDOWN_XML = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>FAULTPROXY</RequestId><HostId>faultproxy</HostId></Error>"
)
S3_INTERNAL_ERROR_XML = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>InternalError</Code><Message>We encountered an internal error. Please try "
    b"again.</Message><RequestId>FAULTPROXY</RequestId><HostId>faultproxy</HostId></Error>"
)
GCS_RATE_LIMIT_JSON = (
    b'{"error":{"code":429,"message":"The rate of change requests to the object is too high.",'
    b'"errors":[{"domain":"usageLimits","reason":"rateLimitExceeded",'
    b'"message":"The rate of change requests to the object is too high."}]}}'
)
AZURE_SERVER_BUSY_XML = (
    b'<?xml version="1.0" encoding="utf-8"?>\n'
    b"<Error><Code>ServerBusy</Code><Message>The server is busy. RequestId:faultproxy</Message>"
    b"</Error>"
)

_BUF = 1 << 20
_MAX_HEAD = 1 << 20
_NO_BODY_STATUSES = frozenset((204, 304))


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True, kw_only=True, eq=False)
class FaultRule:
    """What to inject into which requests.

    Rules compare by identity, so two equal-looking rules keep separate counts.

    Args:
        action: One of ``"status"``, ``"reset"``, ``"delay"``, ``"truncate"``,
            ``"fail_after_bytes"``, ``"corrupt"`` (see the module docstring).
        method: HTTP method to match (case-insensitive); ``None`` matches any.
        path_regex: Regular expression searched in the request target (path and query
            string, e.g. ``/bucket/key?partNumber=2&uploadId=...``); ``None`` matches any.
        header: ``(name, regex)``: the request must have header ``name`` (case-insensitive)
            with a value the regex is found in.
        times: How many matching requests get the fault; ``None`` means every one.
        skip: Let this many matching requests through untouched before injecting.
        status: HTTP status for ``"status"``.
        body: Response body for ``"status"``.
        headers: Extra response headers for ``"status"`` (``Content-Type`` is guessed from the
            body when not given).
        delay_s: Seconds to wait for ``"delay"``.
        nbytes: Byte count for ``"truncate"`` (response body bytes sent before closing) and
            ``"fail_after_bytes"`` (request body bytes forwarded before closing; required), and
            ``"corrupt"`` (payload offset of the flipped byte; default the middle).
        name: Label for logs and :class:`RuleStats`.
    """

    action: FaultAction
    method: str | None = None
    path_regex: str | None = None
    header: tuple[str, str] | None = None
    times: int | None = 1
    skip: int = 0
    status: int = 503
    body: bytes | str = b""
    headers: Mapping[str, str] | None = None
    delay_s: float = 0.0
    nbytes: int | None = None
    name: str | None = None
    _path_re: re.Pattern[str] | None = field(init=False, repr=False, default=None)
    _header_re: re.Pattern[str] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(
                f"FaultRule.action must be one of {sorted(_ACTIONS)}, got {self.action!r}"
            )
        if self.times is not None and self.times < 0:
            raise ValueError(f"FaultRule.times must be >= 0 or None (forever), got {self.times}")
        if self.skip < 0:
            raise ValueError(f"FaultRule.skip must be >= 0, got {self.skip}")
        if not 100 <= self.status <= 599:
            raise ValueError(f"FaultRule.status must be an HTTP status 100..599, got {self.status}")
        if self.delay_s < 0:
            raise ValueError(f"FaultRule.delay_s must be >= 0, got {self.delay_s}")
        if self.nbytes is not None and self.nbytes < 0:
            raise ValueError(f"FaultRule.nbytes must be >= 0, got {self.nbytes}")
        if self.action == "fail_after_bytes" and self.nbytes is None:
            raise ValueError("FaultRule(action='fail_after_bytes') needs nbytes=")
        if self.header is not None and len(self.header) != 2:
            raise ValueError(f"FaultRule.header must be (name, regex), got {self.header!r}")
        if self.path_regex is not None:
            object.__setattr__(self, "_path_re", re.compile(self.path_regex))
        if self.header is not None:
            object.__setattr__(self, "_header_re", re.compile(self.header[1]))
        if isinstance(self.body, str):
            object.__setattr__(self, "body", self.body.encode())

    @property
    def label(self) -> str:
        """``name`` if given, else a short description."""
        if self.name:
            return self.name
        what = self.action if self.action != "status" else f"status {self.status}"
        return f"{what} on {self.method or '*'} {self.path_regex or '*'}"

    def matches(self, method: str, target: str, headers: Mapping[str, str]) -> bool:
        """True when a request with this method, target and (lowercased) headers matches."""
        if self.method is not None and self.method.upper() != method:
            return False
        if self._path_re is not None and not self._path_re.search(target):
            return False
        if self.header is not None:
            assert self._header_re is not None
            value = headers.get(self.header[0].lower())
            if value is None or not self._header_re.search(value):
                return False
        return True


def s3_slowdown(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering 503 SlowDown like S3. ``kwargs`` go to :class:`FaultRule`."""
    opts: dict[str, Any] = {"status": 503, "body": S3_SLOWDOWN_XML, "name": "s3 SlowDown", **kwargs}
    return FaultRule(action="status", **opts)


def s3_internal_error(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering 500 InternalError like S3."""
    opts: dict[str, Any] = {
        "status": 500,
        "body": S3_INTERNAL_ERROR_XML,
        "name": "s3 InternalError",
        **kwargs,
    }
    return FaultRule(action="status", **opts)


def gcs_rate_limited(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering 429 rateLimitExceeded like the GCS JSON API."""
    opts: dict[str, Any] = {
        "status": 429,
        "body": GCS_RATE_LIMIT_JSON,
        "name": "gcs 429",
        **kwargs,
    }
    return FaultRule(action="status", **opts)


def azure_throttled(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering ServerBusy (with ``x-ms-error-code``) like Azure Blob.

    The default status is 503, which is what Blob storage sends when it throttles and what
    azure-storage-blob retries. Pass ``status=429`` for the generic Azure throttling answer:
    azure-storage-blob does *not* retry 429 (its ``is_retry`` treats 4xx other than 408 as
    final). Its default ``ExponentialRetry`` waits ~15 s before the first retry, and adlfs
    offers no way to change that.
    """
    opts: dict[str, Any] = {
        "status": 503,
        "body": AZURE_SERVER_BUSY_XML,
        "headers": {"x-ms-error-code": "ServerBusy"},
        "name": "azure ServerBusy",
        **kwargs,
    }
    return FaultRule(action="status", **opts)


@dataclass(frozen=True, kw_only=True)
class NetworkProfile:
    """Simulated network conditions for benchmarks (all off by default).

    Args:
        first_byte_delay_s: Added once per request before the response is sent.
        per_connection_bytes_per_s: Bandwidth cap of each client connection, applied
            separately to each direction (token bucket, ~50 ms burst); ``None``: no cap.
    """

    first_byte_delay_s: float = 0.0
    per_connection_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.first_byte_delay_s < 0:
            raise ValueError(f"first_byte_delay_s must be >= 0, got {self.first_byte_delay_s}")
        if self.per_connection_bytes_per_s is not None and self.per_connection_bytes_per_s <= 0:
            raise ValueError(
                "per_connection_bytes_per_s must be > 0 or None (no cap), got "
                f"{self.per_connection_bytes_per_s}"
            )


@dataclass(frozen=True)
class RuleStats:
    """Counts for one rule: requests that matched it, and faults it injected."""

    rule: FaultRule
    matched: int
    injected: int


@dataclass(frozen=True)
class ProxyStats:
    """A snapshot of the proxy's counters."""

    connections: int
    active_connections: int
    requests: int
    faults_injected: int
    rules: tuple[RuleStats, ...]

    def rule(self, rule: FaultRule) -> RuleStats:
        """Stats of ``rule`` (by identity). Raises :class:`KeyError` if it is not installed."""
        for stats in self.rules:
            if stats.rule is rule:
                return stats
        raise KeyError(f"rule not installed: {rule.label}")


@dataclass
class _RuleState:
    rule: FaultRule
    matched: int = 0
    injected: int = 0


# ---------------------------------------------------------------------------------------------
# HTTP plumbing


class _Cut(Exception):
    """A byte limit was reached and the connection must be closed now."""


class _ProtocolError(Exception):
    """Unparseable HTTP."""


@dataclass
class _Head:
    start_line: bytes
    headers: list[tuple[bytes, bytes]]
    fields: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        lines = raw.split(b"\r\n")
        start_line = lines[0]
        headers: list[tuple[bytes, bytes]] = []
        fields: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise _ProtocolError(f"bad header line {line[:80]!r}")
            name, value = name.strip(), value.strip()
            headers.append((name, value))
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            fields[key] = f"{fields[key]}, {text}" if key in fields else text
        return cls(start_line, headers, fields)

    def serialize(
        self, *, drop: frozenset[bytes] = frozenset(), replace: Mapping[bytes, bytes] | None = None
    ) -> bytes:
        parts = [self.start_line]
        for name, value in self.headers:
            lname = name.lower()
            if lname in drop:
                continue
            if replace and lname in replace:
                value = replace[lname]
            parts.append(name + b": " + value)
        parts.append(b"")
        parts.append(b"")
        return b"\r\n".join(parts)

    def body_framing(self) -> tuple[str, int]:
        """("chunked", 0) | ("length", n) | ("none", 0) as for a request."""
        if "chunked" in self.fields.get("transfer-encoding", "").lower():
            return "chunked", 0
        cl = self.fields.get("content-length")
        if cl is not None:
            try:
                n = int(cl.split(",")[0])
            except ValueError as exc:
                raise _ProtocolError(f"bad Content-Length {cl!r}") from exc
            return "length", n
        return "none", 0

    def wants_close(self) -> bool:
        conn = self.fields.get("connection", "").lower()
        if "close" in conn:
            return True
        return self.start_line.endswith(b"HTTP/1.0") and "keep-alive" not in conn


class _TokenBucket:
    """Debt-based token bucket: spend first, then sleep off any deficit."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(16384.0, rate * 0.05)
        self.chunk = int(min(self.capacity, _BUF))
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    async def consume(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class _Sink:
    """Writes to one side of a connection, with an optional byte limit and bandwidth cap.

    With ``writer=None`` it discards what it is given (to read a request we answer ourselves).
    """

    def __init__(
        self,
        writer: asyncio.StreamWriter | None,
        bucket: _TokenBucket | None = None,
        limit: int | None = None,
        flip_at: int | None = None,
    ) -> None:
        self.writer = writer
        self.bucket = bucket
        self.limit = limit
        self.flip_at = flip_at  # payload offset of the byte to corrupt (chunk framing excluded)
        self.sent = 0
        self.payload_sent = 0

    async def send(self, data: bytes | bytearray | memoryview, *, payload: bool = True) -> None:
        if payload:
            at = None if self.flip_at is None else self.flip_at - self.payload_sent
            self.payload_sent += len(data)
            if at is not None and 0 <= at < len(data):
                data = bytearray(data)
                data[at] ^= 0xFF
        cut = False
        if self.limit is not None and self.sent + len(data) > self.limit:
            data = memoryview(data)[: self.limit - self.sent]
            cut = True
        if self.writer is None:
            pass
        elif self.bucket is None:
            if data:
                self.writer.write(data)
                await self.writer.drain()
        else:
            view = memoryview(data)
            step = self.bucket.chunk
            for i in range(0, len(view), step):
                piece = view[i : i + step]
                await self.bucket.consume(len(piece))
                self.writer.write(piece)
                await self.writer.drain()
        self.sent += len(data)
        if cut:
            raise _Cut


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """Read one message head (up to the blank line); ``None`` on a clean EOF between messages."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise
    except asyncio.LimitOverrunError as exc:
        raise _ProtocolError("message head too large") from exc
    # Tolerate stray CRLFs between pipelined messages (RFC 9112 section 2.2).
    return raw.lstrip(b"\r\n")


async def _relay_exact(reader: asyncio.StreamReader, sink: _Sink, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, _BUF))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        await sink.send(data)


async def _relay_until_eof(reader: asyncio.StreamReader, sink: _Sink) -> None:
    while data := await reader.read(_BUF):
        await sink.send(data)


async def _relay_chunked(reader: asyncio.StreamReader, sink: _Sink) -> None:
    """Relay a chunked body verbatim (framing included), parsing only the chunk sizes."""
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise _ProtocolError(f"bad chunk size line {line[:40]!r}") from exc
        await sink.send(line, payload=False)
        if size == 0:
            while True:  # trailers, then the final CRLF
                trailer = await reader.readuntil(b"\r\n")
                await sink.send(trailer, payload=False)
                if trailer == b"\r\n":
                    return
        await _relay_exact(reader, sink, size)
        await sink.send(await reader.readexactly(2), payload=False)


async def _relay_body(reader: asyncio.StreamReader, sink: _Sink, framing: str, length: int) -> None:
    if framing == "chunked":
        await _relay_chunked(reader, sink)
    elif framing == "length":
        await _relay_exact(reader, sink, length)
    elif framing == "eof":
        await _relay_until_eof(reader, sink)


def _abort(writer: asyncio.StreamWriter | None, *, rst: bool) -> None:
    """Close a connection at once; with ``rst`` the peer gets a TCP RST instead of a FIN."""
    if writer is None:
        return
    if rst:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# ---------------------------------------------------------------------------------------------
# the proxy

_LIVE_PROXIES: weakref.WeakSet[FaultProxy] = weakref.WeakSet()


@atexit.register
def _stop_all_proxies() -> None:
    for proxy in list(_LIVE_PROXIES):
        with contextlib.suppress(Exception):
            proxy.stop()


class FaultProxy:
    """A fault-injecting HTTP/1.1 reverse proxy in front of one upstream server.

    Args:
        upstream: The server: a :class:`~dcp_volumes.testing.servers.LocalServer` (running),
            or a base URL ``http://host:port`` (any path is ignored).
        host: Interface to listen on.
        port: Port to listen on; 0 picks a free one.
        profile: Network profile; default: none (full speed, no delay).
        connect_timeout: Seconds to wait when connecting to the upstream.
    """

    def __init__(
        self,
        upstream: str | LocalServer,
        /,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        profile: NetworkProfile | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self._server_obj: LocalServer | None = None
        if isinstance(upstream, str):
            url = upstream
        else:
            self._server_obj = upstream
            url = upstream.endpoint_url
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(
                f"upstream must be an http://host:port URL or a LocalServer, got {url!r}"
            )
        self.upstream_host: str = parsed.hostname
        self.upstream_port: int = parsed.port or 80
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self._profile = profile or NetworkProfile()
        self._rules: list[_RuleState] = []
        self._lock = threading.Lock()
        self._connections = 0
        self._active = 0
        self._requests = 0
        self._faults = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._aserver: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy (valid after :meth:`start`)."""
        if self._thread is None:
            raise RuntimeError("FaultProxy is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def upstream_url(self) -> str:
        """Base URL of the upstream server."""
        return f"http://{self.upstream_host}:{self.upstream_port}"

    def start(self) -> None:
        """Start listening (in a background thread). Does nothing if already running."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        started: dict[str, BaseException | None] = {"error": None}
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._aserver = loop.run_until_complete(
                    asyncio.start_server(
                        self._handle, self.host, self.port, limit=_MAX_HEAD, backlog=1024
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - start() re-raises it in its thread
                started["error"] = exc
                ready.set()
                loop.close()
                return
            self.port = self._aserver.sockets[0].getsockname()[1]
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        thread = threading.Thread(target=run, name=f"FaultProxy->{self.upstream_url}", daemon=True)
        thread.start()
        ready.wait()
        if started["error"] is not None:
            thread.join()
            raise started["error"]
        self._loop = loop
        self._thread = thread
        _LIVE_PROXIES.add(self)
        logger.info("fault proxy %s -> %s", self.endpoint_url, self.upstream_url)

    def stop(self) -> None:
        """Close the listener and every connection, and end the thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError, TimeoutError, asyncio.CancelledError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = None
        self._loop = None
        _LIVE_PROXIES.discard(self)

    async def _shutdown(self) -> None:
        if self._aserver is not None:
            self._aserver.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"http://{self.host}:{self.port}" if self._thread else "stopped"
        return f"<FaultProxy {where} -> {self.upstream_url}>"

    # -- client configuration --------------------------------------------------------------

    def storage_options(self) -> dict[str, Any]:
        """The upstream server's fsspec options, pointed at the proxy (needs a LocalServer)."""
        return self._require_server().storage_options(endpoint_url=self.endpoint_url)

    def env(self) -> dict[str, str]:
        """The upstream server's environment variables, pointed at the proxy."""
        return self._require_server().env(endpoint_url=self.endpoint_url)

    def _require_server(self) -> LocalServer:
        if self._server_obj is None:
            raise RuntimeError(
                "FaultProxy was given a URL, not a LocalServer; build options yourself"
            )
        return self._server_obj

    # -- rules, profile, stats -------------------------------------------------------------

    def add_rule(self, rule: FaultRule) -> FaultRule:
        """Install ``rule`` after the existing ones and return it (to look up its stats)."""
        with self._lock:
            self._rules.append(_RuleState(rule))
        return rule

    def remove_rule(self, rule: FaultRule) -> None:
        """Uninstall ``rule`` (by identity); does nothing if it is not installed."""
        with self._lock:
            self._rules = [s for s in self._rules if s.rule is not rule]

    def clear_rules(self) -> None:
        """Uninstall every rule (their stats go with them)."""
        with self._lock:
            self._rules = []

    @property
    def profile(self) -> NetworkProfile:
        """The network profile; assign a new :class:`NetworkProfile` to change it."""
        return self._profile

    @profile.setter
    def profile(self, profile: NetworkProfile | None) -> None:
        self._profile = profile or NetworkProfile()

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        with self._lock:
            return ProxyStats(
                connections=self._connections,
                active_connections=self._active,
                requests=self._requests,
                faults_injected=self._faults,
                rules=tuple(RuleStats(s.rule, s.matched, s.injected) for s in self._rules),
            )

    def reset_stats(self) -> None:
        """Zero the global and per-rule counters."""
        with self._lock:
            self._connections = self._requests = self._faults = 0
            for state in self._rules:
                state.matched = state.injected = 0

    def _select(self, method: str, target: str, fields: Mapping[str, str]) -> FaultRule | None:
        with self._lock:
            self._requests += 1
            for state in self._rules:
                rule = state.rule
                if not rule.matches(method, target, fields):
                    continue
                state.matched += 1
                if state.matched <= rule.skip:
                    continue
                if rule.times is not None and state.injected >= rule.times:
                    continue
                state.injected += 1
                self._faults += 1
                return rule
        return None

    # -- per connection --------------------------------------------------------------------

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self._connections += 1
            self._active += 1
        conn = _Connection(self, creader, cwriter)
        try:
            await conn.serve()
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - one broken connection must not stop the proxy
            logger.debug("fault proxy connection ended: %r", exc)
        finally:
            conn.close()
            with self._lock:
                self._active -= 1
            self._tasks.discard(task)


class _Connection:
    """One client connection and the upstream connection it uses (opened lazily)."""

    def __init__(
        self, proxy: FaultProxy, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.creader = creader
        self.cwriter = cwriter
        self.ureader: asyncio.StreamReader | None = None
        self.uwriter: asyncio.StreamWriter | None = None
        self._buckets: dict[str, _TokenBucket] = {}
        cwriter.transport.set_write_buffer_limits(high=4 * _BUF)
        self._location_from = proxy.upstream_url.encode()

    def close(self) -> None:
        for writer in (self.cwriter, self.uwriter):
            if writer is not None:
                writer.close()

    def _bucket(self, direction: str) -> _TokenBucket | None:
        rate = self.proxy.profile.per_connection_bytes_per_s
        if rate is None:
            return None
        bucket = self._buckets.get(direction)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[direction] = _TokenBucket(rate)
        return bucket

    async def _upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """The upstream connection, (re)opened if the server closed it; third item: reused."""
        if (
            self.ureader is not None
            and self.uwriter is not None
            and not self.ureader.at_eof()
            and not self.uwriter.is_closing()
        ):
            return self.ureader, self.uwriter, True
        if self.uwriter is not None:
            self.uwriter.transport.abort()
        proxy = self.proxy
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(proxy.upstream_host, proxy.upstream_port, limit=_MAX_HEAD),
            proxy.connect_timeout,
        )
        writer.transport.set_write_buffer_limits(high=4 * _BUF)
        self.ureader, self.uwriter = reader, writer
        return reader, writer, False

    async def serve(self) -> None:
        while True:
            raw = await _read_head(self.creader)
            if raw is None:
                return
            req = _Head.parse(raw)
            parts = req.start_line.split(b" ")
            if len(parts) != 3:
                raise _ProtocolError(f"bad request line {req.start_line[:80]!r}")
            method = parts[0].decode("latin-1").upper()
            target = parts[1].decode("latin-1")
            if "://" in target:  # absolute-form: match on path and query only
                split = urllib.parse.urlsplit(target)
                target = split.path + (f"?{split.query}" if split.query else "")
            framing, length = req.body_framing()
            has_body = framing == "chunked" or length > 0
            if "100-continue" in req.fields.get("expect", "").lower() and has_body:
                # Answer it here so every action sees the whole body; the upstream never sees
                # the Expect header (which SigV4 does not sign).
                self.cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await self.cwriter.drain()
            rule = self.proxy._select(method, target, req.fields)
            if rule is not None:
                logger.debug(
                    "fault proxy: %s on %s %s", rule.label, method, target.split("?", 1)[0]
                )
            keep_alive = await self._exchange(req, method, framing, length, rule)
            if not keep_alive or req.wants_close():
                return

    async def _exchange(
        self, req: _Head, method: str, framing: str, length: int, rule: FaultRule | None
    ) -> bool:
        """Handle one request; return whether the client connection stays open."""
        action = rule.action if rule is not None else None
        if rule is not None and action in ("status", "reset"):
            await _relay_body(self.creader, _Sink(None), framing, length)
            if action == "reset":
                _abort(self.cwriter, rst=True)
                return False
            await self._send_canned(rule, method)
            return True
        if rule is not None and action == "delay":
            await asyncio.sleep(rule.delay_s)

        ureader, uwriter, reused = await self._upstream_or_abort()
        if ureader is None or uwriter is None:
            return False
        uwriter.write(req.serialize(drop=frozenset((b"expect",))))
        limit = rule.nbytes if rule is not None and action == "fail_after_bytes" else None
        flip_at = None
        if rule is not None and action == "corrupt":
            flip_at = rule.nbytes if rule.nbytes is not None else length // 2
        try:
            await _relay_body(
                self.creader, _Sink(uwriter, self._bucket("up"), limit, flip_at), framing, length
            )
        except _Cut:
            _abort(self.cwriter, rst=True)
            _abort(uwriter, rst=True)
            return False

        raw = await _read_head(ureader)
        while raw is not None and 100 <= _status_of(raw.split(b"\r\n", 1)[0]) < 200:
            raw = await _read_head(ureader)  # interim responses: we answered 100 ourselves
        if raw is None:
            # The upstream closed without answering (e.g. an idle keep-alive timeout raced our
            # request). Close the client connection the same way; clients retry that.
            logger.debug("fault proxy: upstream closed before responding (reused=%s)", reused)
            _abort(self.cwriter, rst=False)
            return False
        resp = _Head.parse(raw)
        status = _status_of(resp.start_line)
        if method == "HEAD" or status in _NO_BODY_STATUSES or status < 200:
            rframing, rlength = "none", 0
        else:
            rframing, rlength = resp.body_framing()
            if rframing == "none":
                rframing = "eof"
        replace: dict[bytes, bytes] = {}
        location = resp.fields.get("location")
        if location is not None and location.encode("latin-1").startswith(self._location_from):
            replace[b"location"] = (
                self.proxy.endpoint_url.encode()
                + location.encode("latin-1")[len(self._location_from) :]
            )
        delay = self.proxy.profile.first_byte_delay_s
        if delay:
            await asyncio.sleep(delay)
        csink = _Sink(self.cwriter, self._bucket("down"))
        await csink.send(resp.serialize(replace=replace))
        if action == "truncate":
            assert rule is not None
            nbytes = (
                rule.nbytes
                if rule.nbytes is not None
                else (rlength // 2 if rframing == "length" else 0)
            )
            csink.limit = csink.sent + nbytes
            try:
                await _relay_body(ureader, csink, rframing, rlength)
            except _Cut:
                pass
            _abort(self.cwriter, rst=False)
            _abort(uwriter, rst=False)
            return False
        await _relay_body(ureader, csink, rframing, rlength)
        if rframing == "eof" or resp.wants_close():
            _abort(uwriter, rst=False)
            return False
        return True

    async def _upstream_or_abort(
        self,
    ) -> tuple[asyncio.StreamReader | None, asyncio.StreamWriter | None, bool]:
        try:
            return await self._upstream()
        except (OSError, asyncio.TimeoutError) as exc:
            # Behave like the unreachable server would: the client sees its connection drop.
            logger.warning(
                "fault proxy: cannot reach upstream %s: %r", self.proxy.upstream_url, exc
            )
            _abort(self.cwriter, rst=True)
            return None, None, False

    async def _send_canned(self, rule: FaultRule, method: str) -> None:
        body = rule.body if isinstance(rule.body, bytes) else rule.body.encode()
        try:
            reason = http.HTTPStatus(rule.status).phrase
        except ValueError:
            reason = "Fault"
        headers = {k.lower(): v for k, v in (rule.headers or {}).items()}
        if body and "content-type" not in headers:
            stripped = body.lstrip()
            headers["content-type"] = (
                "application/xml"
                if stripped.startswith(b"<")
                else "application/json"
                if stripped.startswith(b"{")
                else "text/plain"
            )
        headers["content-length"] = str(len(body))
        headers.setdefault("x-amz-request-id", "FAULTPROXY")
        headers.setdefault("date", time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()))
        head = (
            f"HTTP/1.1 {rule.status} {reason}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        delay = self.proxy.profile.first_byte_delay_s
        if delay:
            await asyncio.sleep(delay)
        sink = _Sink(self.cwriter, self._bucket("down"))
        await sink.send(head.encode("latin-1") + (b"" if method == "HEAD" else body))


def _status_of(start_line: bytes) -> int:
    parts = start_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise _ProtocolError(f"bad status line {start_line[:80]!r}")
    try:
        return int(parts[1])
    except ValueError as exc:
        raise _ProtocolError(f"bad status line {start_line[:80]!r}") from exc
