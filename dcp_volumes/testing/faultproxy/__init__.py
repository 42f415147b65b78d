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
``ignore_range``      forward the request without its ``Range``/``x-ms-range`` header: the
                      upstream answers 200 with the whole object, as a store that ignores
                      ``Range`` does (:func:`ignore_range`).
``shift_range``       forward the request with its range moved ``nbytes`` (default 1) further:
                      the upstream answers another range than the client asked for
                      (:func:`shift_range`). Both change a request header, so they suit
                      upstreams that do not check a signature over it (moto, fake-gcs-server,
                      Azurite read through a SAS).

:func:`cut_body` is a ``truncate`` rule for every GET (half of each body, then the
connection closes).

A :class:`PrefixRateLimit` (``proxy.add_rate_limit(PrefixRateLimit(rate=50))``) limits the
request rate of each key prefix with a token bucket and answers 503 SlowDown above it, as S3
does per partitioned prefix; its counters (accepted and throttled, per prefix) are in
``proxy.stats.rate_limit(limit)``.

A :class:`NetworkProfile` (for benchmarks) adds a first-byte delay to every response and caps
each connection's bandwidth with a token bucket, separately in each direction. Both are off by
default; with the profile off the proxy only copies 1 MiB buffers and is not the bottleneck at
~100 MB/s.

``Expect: 100-continue`` is answered by the proxy itself (and stripped upstream), so that
rules can read the whole request body before deciding what to do.

The proxy runs an asyncio loop in a daemon thread; all public methods are thread-safe.

Modules: ``_rules`` (:class:`FaultRule`, its ready-made constructors, :class:`PrefixRateLimit`,
:class:`NetworkProfile`, the stats), ``_http`` (message heads, body relays, the token bucket),
``_proxy`` (:class:`FaultProxy`) and ``_connection`` (one client connection).
"""

from __future__ import annotations

from dcp_volumes.testing.faultproxy._proxy import FaultProxy
from dcp_volumes.testing.faultproxy._rules import (
    AZURE_SERVER_BUSY_XML,
    GCS_RATE_LIMIT_JSON,
    S3_INTERNAL_ERROR_XML,
    S3_SLOWDOWN_XML,
    FaultAction,
    FaultRule,
    NetworkProfile,
    PrefixCounts,
    PrefixRateLimit,
    ProxyStats,
    RateLimitStats,
    RuleStats,
    azure_throttled,
    cut_body,
    gcs_rate_limited,
    ignore_range,
    s3_internal_error,
    s3_slowdown,
    shift_range,
)

__all__ = [
    "AZURE_SERVER_BUSY_XML",
    "GCS_RATE_LIMIT_JSON",
    "S3_INTERNAL_ERROR_XML",
    "S3_SLOWDOWN_XML",
    "FaultAction",
    "FaultProxy",
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
