"""Requests counted at the store: S3 requests, as logged by a
:class:`~dcp_volumes.testing.faultproxy.FaultProxy` in front of the server
(:meth:`~dcp_volumes.testing.faultproxy.FaultProxy.record_requests`), sorted by kind and by
the object they name.

Kinds: ``LIST`` (object and multipart-upload listings), ``HEAD``, ``GET``, ``PUT`` (one
request writes the object), ``MULTIPART`` (create, upload part, complete, abort),
``DELETE`` (one object) and ``DELETE_BATCH`` (S3 DeleteObjects: up to 1,000 per request).
Objects: ``metadata``, ``manifest``, ``shard``, ``live`` (a save's live record), ``bucket``
(a request that names no object: listings) and ``other``. The **control plane** is every
request but the GETs and writes of shard bytes.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from dcp_volumes import _layout

__all__ = ["KINDS", "Count", "classify", "count"]

KINDS = ("LIST", "HEAD", "GET", "PUT", "MULTIPART", "DELETE", "DELETE_BATCH")
_DATA_KINDS = frozenset({"GET", "PUT", "MULTIPART"})


def _object_of(key: str) -> str:
    """What an object key inside the bucket names."""
    name = key.rsplit("/", 1)[-1]
    if name == _layout.METADATA:
        return "metadata"
    if name.startswith(_layout.MANIFEST_PREFIX):
        return "manifest"
    if name.endswith(_layout.SHARD_SUFFIX):
        return "shard"
    if name.startswith(_layout.LIVE_PREFIX):
        return "live"
    return "other"


def _kind(method: str, query: dict[str, list[str]], is_bucket: bool) -> str:
    if method == "HEAD":
        return "HEAD"
    if method == "GET":
        listing = is_bucket or "list-type" in query or "uploads" in query or "prefix" in query
        return "LIST" if listing else "GET"
    if method == "POST" and "delete" in query:
        return "DELETE_BATCH"
    if "uploads" in query or "uploadId" in query or "partNumber" in query:
        return "MULTIPART"
    return "DELETE" if method == "DELETE" else "PUT"


def classify(method: str, target: str, bucket: str) -> tuple[str, str]:
    """``(kind, object)`` of one path-style S3 request to ``bucket``."""
    parts = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    path = urllib.parse.unquote(parts.path).lstrip("/")
    inside = path[len(bucket):].lstrip("/") if path.startswith(bucket) else path
    is_bucket = not inside
    obj = "bucket" if is_bucket else _object_of(inside)
    return _kind(method.upper(), query, is_bucket), obj


@dataclass
class Count:
    """Requests by kind and by (kind, object)."""

    by_kind: Counter[str] = field(default_factory=Counter)
    by_object: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def control(self) -> int:
        """Every request but the reads and writes of shard bytes."""
        return sum(self.control_by_kind().values())

    def control_by_kind(self) -> Counter[str]:
        """The control-plane requests by kind."""
        out: Counter[str] = Counter()
        for (kind, obj), n in self.by_object.items():
            if not (obj == "shard" and kind in _DATA_KINDS):
                out[kind] += n
        return out

    def of(self, kind: str, obj: str) -> int:
        return self.by_object[(kind, obj)]

    def as_dict(self) -> dict[str, int]:
        return {k: self.by_kind[k] for k in KINDS} | {"total": self.total,
                                                       "control": self.control}


def count(requests: Iterable[tuple[str, str]], bucket: str) -> Count:
    """Sort logged ``(method, target)`` requests to ``bucket`` (others are left out)."""
    out = Count()
    for method, target in requests:
        path = urllib.parse.urlsplit(target).path.lstrip("/")
        if not path.startswith(bucket):
            continue
        kind, obj = classify(method, target, bucket)
        out.by_kind[kind] += 1
        out.by_object[(kind, obj)] += 1
    return out
