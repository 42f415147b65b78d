"""A rank's descriptor of the files it keeps of one save in the local tier (written last;
torch-free).

A descriptor is untrusted input like anything read from storage: :meth:`Descriptor.parse`
checks every field (types, and every number finite and in range), and a descriptor that
fails makes its save unusable on this node and nothing else. The directory layout around
it: :mod:`._layout`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes import _layout, errors
from dcp_volumes.tier._files import read_bounded, scandir

__all__ = ["DESCRIPTOR_MAX", "DESCRIPTOR_PREFIX", "MAX_FILE_BYTES", "Descriptor", "DurableBase",
           "LocalOnlyRef", "descriptor_name", "descriptors", "is_descriptor_name",
           "read_descriptor"]

DESCRIPTOR_PREFIX = ".dcpv-tier-"
#: a descriptor larger than this is not a descriptor (a rank lists a few files)
DESCRIPTOR_MAX = 1 << 20
#: the largest rank, world size and file size a descriptor may claim
MAX_RANKS = 1 << 24
MAX_FILE_BYTES = 1 << 50
#: ``created`` is epoch seconds: before the year 2500
MAX_CREATED = 1.7e10
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_DESCRIPTOR_RE = re.compile(rf"^{re.escape(DESCRIPTOR_PREFIX)}(\d+)\.json$")


def descriptor_name(rank: int) -> str:
    return f"{DESCRIPTOR_PREFIX}{rank}.json"


def is_descriptor_name(relative: str) -> bool:
    """Whether a file name is (or would be taken for) a rank descriptor."""
    return os.path.basename(relative).startswith(DESCRIPTOR_PREFIX)


def _whole(value: Any, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high)``; ValueError otherwise (bools are not ints)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError("a number out of range")
    return value


@dataclass(frozen=True)
class DurableBase:
    """The durable checkpoint a local-only save continues: its URL (normalised), save id and
    the SHA-256 of its manifest. A local-only save is used at restore only when this is
    exactly the newest durable checkpoint in the store."""

    url: str
    save_id: str
    manifest_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "save_id": self.save_id,
                "manifest_sha256": self.manifest_sha256}

    @classmethod
    def from_json(cls, doc: Any) -> DurableBase:
        url, sid, sha = doc["url"], doc["save_id"], doc["manifest_sha256"]
        if not (isinstance(url, str) and _layout.is_save_id(sid) and isinstance(sha, str)
                and _SHA256_RE.match(sha)):
            raise ValueError("a malformed durable base")
        return cls(url, sid, sha)


@dataclass(frozen=True)
class LocalOnlyRef:
    """What a local-only save's descriptor says of it: its save id, how many ranks saved,
    the SHA-256 of its manifest, and the durable checkpoint it continues (None: it followed
    no durable save)."""

    save_id: str
    world: int
    manifest_sha256: str
    base: DurableBase | None = None

    def to_json(self) -> dict[str, Any]:
        return {"save_id": self.save_id, "world": self.world,
                "manifest_sha256": self.manifest_sha256,
                "base": self.base.to_json() if self.base is not None else None}

    @classmethod
    def from_json(cls, doc: Any, rank: int) -> LocalOnlyRef:
        sid, world, sha = doc["save_id"], doc["world"], doc["manifest_sha256"]
        world = _whole(world, 1, MAX_RANKS + 1)
        if not (_layout.is_save_id(sid) and rank < world and isinstance(sha, str)
                and _SHA256_RE.match(sha)):
            raise ValueError("a malformed local-only record")
        base = doc.get("base")
        return cls(sid, world, sha, DurableBase.from_json(base) if base is not None else None)


@dataclass(frozen=True)
class Descriptor:
    """One rank's descriptor of one save in the tier.

    Attributes:
        url: the checkpoint URL (normalised, see :func:`normal_url`).
        save_key: the save directory's name (the id in the rank's shard names).
        rank: the rank whose files these are.
        created: epoch seconds.
        files: ``{relative path: size}`` of the rank's files.
        local_only: set for a local-only save (see :class:`LocalOnlyRef`).
        held_by: set for a partner replica: the rank of this node that keeps it.
    """

    url: str
    save_key: str
    rank: int
    created: float
    files: Mapping[str, int] = field(default_factory=dict)
    local_only: LocalOnlyRef | None = None
    held_by: int | None = None

    @property
    def replica(self) -> bool:
        return self.held_by is not None

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"format": 1, "url": self.url, "save_key": self.save_key,
                               "rank": self.rank, "created": self.created,
                               "files": dict(self.files)}
        if self.local_only is not None:
            doc["local_only"] = self.local_only.to_json()
        if self.held_by is not None:
            doc["replica"] = {"held_by": self.held_by}
        return json.dumps(doc).encode()

    @classmethod
    def parse(cls, raw: bytes, *, save_key: str, url: str | None = None) -> Descriptor | None:
        """The descriptor in ``raw``, or None when it is not a well-formed one of
        ``save_key`` (and ``url``, when given)."""
        try:
            doc = json.loads(raw)
            durl, files = doc["url"], doc["files"]
            rank = _whole(doc["rank"], 0, MAX_RANKS)
            created = doc["created"]
            if (isinstance(created, bool) or not isinstance(created, (int, float))
                    or not 0 <= created < MAX_CREATED):
                return None
            if (not isinstance(durl, str) or not isinstance(files, dict)
                    or doc.get("save_key") != save_key or (url is not None and durl != url)):
                return None
            out: dict[str, int] = {}
            for rel, size in files.items():
                if is_descriptor_name(rel):
                    return None
                out[_layout.check_relative_path(rel)] = _whole(size, 0, MAX_FILE_BYTES)
            lo = doc.get("local_only")
            local_only = LocalOnlyRef.from_json(lo, rank) if lo is not None else None
            rep = doc.get("replica")
            held_by = _whole(rep["held_by"], 0, MAX_RANKS) if rep is not None else None
            created_s = float(created)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
                RecursionError, errors.UnsafeCheckpointError):
            return None
        if not math.isfinite(created_s):
            return None
        return cls(durl, save_key, rank, created_s, out, local_only, held_by)


def read_descriptor(path: str, url: str | None, save_key: str) -> Descriptor | None:
    """The descriptor at ``path`` (a regular file of bounded size, no link), or None."""
    raw = read_bounded(path, DESCRIPTOR_MAX)
    return None if raw is None else Descriptor.parse(raw, save_key=save_key, url=url)


def descriptors(save_dir: str, url: str | None, save_key: str) -> list[Descriptor]:
    """Every well-formed rank descriptor in one save directory."""
    out = []
    for entry in scandir(save_dir):
        if _DESCRIPTOR_RE.match(entry.name):
            d = read_descriptor(entry.path, url, save_key)
            if d is not None:
                out.append(d)
    return out
