"""The local tier's directory layout and its descriptors (torch-free: the catalog lists
tiers without importing torch).

::

    <tier>/<url key>/<save key>/<relative shard path>     a shard file, as it was uploaded
    <tier>/<url key>/<save key>/.dcpv-tier-<rank>.json    one rank's descriptor, written last

``url key``: the first 16 hex digits of the SHA-256 of the checkpoint URL (credentials
stripped, no trailing slash). ``save key``: the id in the rank's shard names. Ranks on one
node may share a tier: shard names carry the rank, descriptors too.

A descriptor is untrusted input like anything read from storage: :meth:`Descriptor.parse`
checks every field (types, and every number finite and in range), and a descriptor that
fails makes its save unusable on this node and nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends.translate import redact_url

__all__ = ["DESCRIPTOR_MAX", "DESCRIPTOR_PREFIX", "STALE_S", "Descriptor", "DurableBase",
           "LocalOnlyRef", "SaveDir", "copy_file", "descriptor_name", "descriptors",
           "is_descriptor_name", "is_save_key", "is_url_key", "name_under", "normal_url",
           "read_bounded", "read_descriptor", "remove_empty_dirs", "scandir", "unlink_quietly",
           "url_key", "walk_saves", "write_atomic"]

DESCRIPTOR_PREFIX = ".dcpv-tier-"
#: a descriptor larger than this is not a descriptor (a rank lists a few files)
DESCRIPTOR_MAX = 1 << 20
#: a save directory with no descriptor this old is what a killed save left: removed
STALE_S = 3600.0
#: the largest rank, world size and file size a descriptor may claim
MAX_RANKS = 1 << 24
MAX_FILE_BYTES = 1 << 50
#: ``created`` is epoch seconds: before the year 2500
MAX_CREATED = 1.7e10
_URL_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_SAVE_KEY_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{12}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_DESCRIPTOR_RE = re.compile(rf"^{re.escape(DESCRIPTOR_PREFIX)}(\d+)\.json$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def normal_url(url: str | os.PathLike[str]) -> str:
    """A checkpoint URL as the tier records it: credentials stripped, no trailing slash."""
    return redact_url(os.fspath(url)).rstrip("/")


def url_key(url: str) -> str:
    """The directory name of a checkpoint URL's saves in the tier."""
    return hashlib.sha256(normal_url(url).encode()).hexdigest()[:16]


def name_under(root: str | os.PathLike[str], url: str) -> str | None:
    """The checkpoint's name directly under the run ``root`` (``step-00000100``), or None
    when ``url`` is not one level under it. Local paths compare as absolute paths."""
    def norm(u: str) -> str:
        n = normal_url(u)
        return n if "://" in n else os.path.abspath(n)

    prefix = norm(os.fspath(root)) + "/"
    u = norm(url)
    name = u[len(prefix):] if u.startswith(prefix) else ""
    return name if name and "/" not in name else None


def descriptor_name(rank: int) -> str:
    return f"{DESCRIPTOR_PREFIX}{rank}.json"


def is_descriptor_name(relative: str) -> bool:
    """Whether a file name is (or would be taken for) a rank descriptor."""
    return os.path.basename(relative).startswith(DESCRIPTOR_PREFIX)


def is_url_key(name: str) -> bool:
    return _URL_KEY_RE.match(name) is not None


def is_save_key(name: str) -> bool:
    return _SAVE_KEY_RE.match(name) is not None


# ---- descriptors ------------------------------------------------------------------------

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


@dataclass(frozen=True)
class SaveDir:
    """One save directory of the tier: ``<root>/<url_key>/<save_key>``."""

    url_key: str
    save_key: str
    path: str

    def descriptors(self, url: str | None = None) -> list[Descriptor]:
        """The well-formed descriptors here whose URL hashes to this directory."""
        return [d for d in descriptors(self.path, url, self.save_key)
                if url_key(d.url) == self.url_key]


def walk_saves(root: str, url: str | None = None) -> Iterator[SaveDir]:
    """Every save directory in the tier at ``root`` (of ``url`` only, when given); links and
    names that are not tier keys are skipped."""
    keys = [url_key(url)] if url is not None else None
    for udir in scandir(root):
        if not (is_url_key(udir.name) and udir.is_dir(follow_symlinks=False)):
            continue
        if keys is not None and udir.name not in keys:
            continue
        for sdir in scandir(udir.path):
            if is_save_key(sdir.name) and sdir.is_dir(follow_symlinks=False):
                yield SaveDir(udir.name, sdir.name, sdir.path)


# ---- small file helpers -----------------------------------------------------------------

def scandir(directory: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(directory))
    except OSError:
        return []


def read_bounded(path: str, limit: int) -> bytes | None:
    """A regular file's bytes (no link, at most ``limit`` of them), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        left = st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) == st.st_size else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """``data`` durably at ``path``, all or nothing (a temporary name, fsync, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def copy_file(source: str, dest: str) -> None:
    """Copy ``source`` to ``dest`` (no link followed, all or nothing), then remove it."""
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        shutil.copyfile(source, tmp, follow_symlinks=False)
        os.replace(tmp, dest)
    except BaseException:
        unlink_quietly(tmp)
        raise
    unlink_quietly(source)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_empty_dirs(directory: str, root: str) -> None:
    """Remove ``directory`` and its parents up to (not including) ``root`` while empty."""
    directory = os.path.abspath(directory)
    while directory.startswith(root + os.sep):
        try:
            os.rmdir(directory)
        except OSError:
            return
        directory = os.path.dirname(directory)


def is_exdev(exc: OSError) -> bool:
    return exc.errno == errno.EXDEV
