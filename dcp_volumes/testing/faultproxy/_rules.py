"""Fault rules, canned error bodies, the network profile and the proxy's counters."""

from __future__ import annotations

import re
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
    "ProxyStats",
    "RuleStats",
    "azure_throttled",
    "gcs_rate_limited",
    "s3_internal_error",
    "s3_slowdown",
]

FaultAction = Literal["status", "reset", "delay", "truncate", "fail_after_bytes", "corrupt"]
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
