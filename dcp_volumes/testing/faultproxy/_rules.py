"""Fault rules, per-prefix rate limits, canned error bodies, the network profile and the
proxy's counters."""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = [
    "AZURE_SERVER_BUSY_XML",
    "GCS_RATE_LIMIT_JSON",
    "S3_INTERNAL_ERROR_XML",
    "S3_SLOWDOWN_XML",
    "FaultAction",
    "FaultRule",
    "NetworkProfile",
    "PrefixCounts",
    "PrefixRateLimit",
    "ProxyStats",
    "RateLimitStats",
    "RuleStats",
    "azure_throttled",
    "cut_body",
    "gcs_rate_limited",
    "ignore_range",
    "s3_internal_error",
    "s3_slowdown",
    "shift_range",
]

FaultAction = Literal["status", "reset", "delay", "truncate", "fail_after_bytes", "corrupt",
                      "ignore_range", "shift_range"]
_ACTIONS: frozenset[str] = frozenset(get_args(FaultAction))

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


@dataclass(frozen=True, kw_only=True, eq=False)
class FaultRule:
    """What to inject into which requests.

    Rules compare by identity, so two equal-looking rules keep separate counts.

    Args:
        action: One of ``"status"``, ``"reset"``, ``"delay"``, ``"truncate"``,
            ``"fail_after_bytes"``, ``"corrupt"``, ``"ignore_range"``, ``"shift_range"`` (see
            the module docstring).
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
            ``"corrupt"`` (payload offset of the flipped byte; default the middle), and
            ``"shift_range"`` (how far the asked range moves; default 1).
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


def _status_rule(kwargs: dict[str, Any], **defaults: Any) -> FaultRule:
    """A ``status`` rule with these defaults; ``kwargs`` (any :class:`FaultRule` field) win."""
    return FaultRule(action="status", **{**defaults, **kwargs})


def s3_slowdown(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering 503 SlowDown like S3. ``kwargs`` go to :class:`FaultRule`."""
    return _status_rule(kwargs, status=503, body=S3_SLOWDOWN_XML, name="s3 SlowDown")


def s3_internal_error(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering 500 InternalError like S3."""
    return _status_rule(kwargs, status=500, body=S3_INTERNAL_ERROR_XML, name="s3 InternalError")


def gcs_rate_limited(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering 429 rateLimitExceeded like the GCS JSON API."""
    return _status_rule(kwargs, status=429, body=GCS_RATE_LIMIT_JSON, name="gcs 429")


def azure_throttled(**kwargs: Any) -> FaultRule:
    """A ``status`` rule answering ServerBusy (with ``x-ms-error-code``) like Azure Blob.

    The default status is 503, which is what Blob storage sends when it throttles and what
    azure-storage-blob retries. Pass ``status=429`` for the generic Azure throttling answer:
    azure-storage-blob does *not* retry 429 (its ``is_retry`` treats 4xx other than 408 as
    final). Its default ``ExponentialRetry`` waits ~15 s before the first retry, and adlfs
    offers no way to change that.
    """
    return _status_rule(
        kwargs,
        status=503,
        body=AZURE_SERVER_BUSY_XML,
        headers={"x-ms-error-code": "ServerBusy"},
        name="azure ServerBusy",
    )


def ignore_range(**kwargs: Any) -> FaultRule:
    """An ``ignore_range`` rule for ranged GETs: the upstream gets the GET without its
    ``Range`` (``x-ms-range``) header and answers 200 with the whole object, as a store or a
    proxy that ignores ``Range`` does. ``kwargs`` go to :class:`FaultRule`.

    The request is changed: use it against upstreams that do not check a signature over
    that header (moto, fake-gcs-server, Azurite read through a SAS); SeaweedFS, and Azurite
    with a shared key, refuse it (403).
    """
    return FaultRule(**{"action": "ignore_range", "method": "GET", "times": None,
                        "name": "ignore Range", **kwargs})


def shift_range(**kwargs: Any) -> FaultRule:
    """A ``shift_range`` rule for ranged GETs: the upstream is asked for the range moved
    ``nbytes`` (default 1) further, and answers that range's bytes with its (honest)
    ``Content-Range``, as a store that serves another range than asked does. Like
    :func:`ignore_range`, for upstreams that do not check a signature over the header."""
    return FaultRule(**{"action": "shift_range", "method": "GET", "times": None,
                        "name": "shifted Range", **kwargs})


def cut_body(**kwargs: Any) -> FaultRule:
    """A ``truncate`` rule for GETs: the answer's head goes through, then half its body
    (``nbytes`` to choose), then the connection closes, as a dropped connection does."""
    return FaultRule(**{"action": "truncate", "method": "GET", "times": None,
                        "name": "body cut", **kwargs})


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


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefixRateLimit:
    """A request-rate limit per key prefix, answered like S3 when exceeded (503 SlowDown).

    S3 serves about 3,500 PUT/POST/DELETE and 5,500 GET/HEAD requests per second per
    partitioned prefix and answers ``503 SlowDown`` above that; requests it refuses do not
    count against the rate. This models it with one token bucket per prefix: ``rate``
    tokens per second, at most ``burst`` saved up; a request takes a token or gets
    ``answer`` (its body is read and dropped; the upstream never sees it).

    A request's prefix is its path-style target's *directory* (bucket first, object name
    left out), cut to the first ``depth`` components: with ``depth=None``,
    ``/bkt/run/step-1/__0_0.distcp`` and ``/bkt/run/step-1/.metadata`` share the prefix
    ``bkt/run/step-1`` while ``/bkt/run/step-1/3f/__0_0.distcp`` (a hashed layout) is
    ``bkt/run/step-1/3f``. Bucket-level requests (``/bkt``, ``/bkt?list-type=2...``) have
    the prefix ``bkt``.

    Rules compare by identity. Fault rules are consulted first: a request a rule answers is
    not counted here.

    Args:
        rate: Requests per second each prefix accepts.
        burst: Requests a prefix accepts at once after a quiet spell (the bucket size).
            Default: a tenth of a second's worth, at least 1.
        depth: Directory components that make the prefix; ``None``: all of them.
        method: Only requests with this method count and are limited; ``None``: all.
        path_regex: Only requests whose target (path and query) this regex is found in count
            and are limited; ``None``: all.
        answer: The ``status`` rule answered above the rate; default :func:`s3_slowdown`.
            (:func:`gcs_rate_limited` and :func:`azure_throttled` model the other stores.)
        name: Label for logs and :class:`RateLimitStats`.
    """

    rate: float
    burst: float | None = None
    depth: int | None = None
    method: str | None = None
    path_regex: str | None = None
    answer: FaultRule | None = None
    name: str | None = None
    _path_re: re.Pattern[str] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"PrefixRateLimit.rate must be > 0 requests/s, got {self.rate}")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"PrefixRateLimit.burst must be >= 1 request, got {self.burst}")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"PrefixRateLimit.depth must be >= 1 or None, got {self.depth}")
        if self.answer is not None and self.answer.action != "status":
            raise ValueError("PrefixRateLimit.answer must be a 'status' rule (e.g. s3_slowdown())")
        if self.path_regex is not None:
            object.__setattr__(self, "_path_re", re.compile(self.path_regex))
        if self.answer is None:
            object.__setattr__(self, "answer", s3_slowdown())

    @property
    def capacity(self) -> float:
        """The bucket size: ``burst``, or a tenth of a second's worth (at least 1)."""
        return self.burst if self.burst is not None else max(1.0, self.rate / 10)

    @property
    def label(self) -> str:
        return self.name or f"{self.rate:g} req/s per prefix"

    def prefix_of(self, method: str, target: str) -> str | None:
        """The prefix a request counts against; ``None`` if this limit does not apply."""
        if self.method is not None and self.method.upper() != method:
            return None
        if self._path_re is not None and not self._path_re.search(target):
            return None
        path = urllib.parse.unquote(target.split("?", 1)[0])
        parts = [p for p in path.split("/") if p]
        dirs = parts[:-1] if len(parts) > 1 else parts
        if self.depth is not None:
            dirs = dirs[: self.depth]
        return "/".join(dirs)


@dataclass(frozen=True)
class PrefixCounts:
    """One prefix under a :class:`PrefixRateLimit`: requests accepted and throttled, and
    when the first and last accepted one arrived (``time.monotonic()``; 0.0 if none)."""

    accepted: int
    throttled: int
    first_accepted: float
    last_accepted: float

    @property
    def span_s(self) -> float:
        """Seconds from the first accepted request to the last."""
        return max(0.0, self.last_accepted - self.first_accepted)


@dataclass(frozen=True)
class RateLimitStats:
    """Counts for one :class:`PrefixRateLimit`, in total and per prefix."""

    limit: PrefixRateLimit
    accepted: int
    throttled: int
    prefixes: Mapping[str, PrefixCounts]


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
    throttled: int = 0
    rate_limits: tuple[RateLimitStats, ...] = ()

    def rule(self, rule: FaultRule) -> RuleStats:
        """Stats of ``rule`` (by identity). Raises :class:`KeyError` if it is not installed."""
        for stats in self.rules:
            if stats.rule is rule:
                return stats
        raise KeyError(f"rule not installed: {rule.label}")

    def rate_limit(self, limit: PrefixRateLimit) -> RateLimitStats:
        """Stats of ``limit`` (by identity). Raises :class:`KeyError` if it is not installed."""
        for stats in self.rate_limits:
            if stats.limit is limit:
                return stats
        raise KeyError(f"rate limit not installed: {limit.label}")


@dataclass
class _RuleState:
    """An installed rule and its counters (guarded by the proxy's lock)."""

    rule: FaultRule
    matched: int = 0
    injected: int = 0

    def take(self, method: str, target: str, fields: Mapping[str, str]) -> bool:
        """Count a request against the rule; true when the rule injects its fault into it."""
        rule = self.rule
        if not rule.matches(method, target, fields):
            return False
        self.matched += 1
        if self.matched <= rule.skip:
            return False
        if rule.times is not None and self.injected >= rule.times:
            return False
        self.injected += 1
        return True


@dataclass
class _Bucket:
    """One prefix's token bucket and counters (guarded by the proxy's lock)."""

    tokens: float
    stamp: float
    accepted: int = 0
    throttled: int = 0
    first_accepted: float = 0.0
    last_accepted: float = 0.0


@dataclass
class _RateLimitState:
    """An installed rate limit, its buckets and counters (guarded by the proxy's lock)."""

    limit: PrefixRateLimit
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    accepted: int = 0
    throttled: int = 0

    def take(self, method: str, target: str) -> bool | None:
        """Count a request: ``True`` accepted, ``False`` throttled, ``None`` not limited."""
        prefix = self.limit.prefix_of(method, target)
        if prefix is None:
            return None
        now = time.monotonic()
        capacity = self.limit.capacity
        bucket = self.buckets.get(prefix)
        if bucket is None:
            bucket = self.buckets[prefix] = _Bucket(tokens=capacity, stamp=now)
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.stamp) * self.limit.rate)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            bucket.throttled += 1
            self.throttled += 1
            return False
        bucket.tokens -= 1.0
        bucket.accepted += 1
        self.accepted += 1
        if bucket.accepted == 1:
            bucket.first_accepted = now
        bucket.last_accepted = now
        return True

    def snapshot(self) -> RateLimitStats:
        return RateLimitStats(
            self.limit,
            self.accepted,
            self.throttled,
            {
                p: PrefixCounts(b.accepted, b.throttled, b.first_accepted, b.last_accepted)
                for p, b in self.buckets.items()
            },
        )

    def reset(self) -> None:
        self.accepted = self.throttled = 0
        for b in self.buckets.values():
            b.accepted = b.throttled = 0
            b.first_accepted = b.last_accepted = 0.0
