"""The local tier: a node-local replica of each save, read first when loading.

::

    <tier>/<url key>/<save key>/<relative shard path>     a shard file, as it was uploaded
    <tier>/<url key>/<save key>/.dcpv-tier-<rank>.json    one rank's descriptor, written last

``url key``: the first 16 hex digits of the SHA-256 of the checkpoint URL (credentials
stripped, no trailing slash). ``save key``: the id in the rank's shard names — the save id
(a rank whose plan DCP served from its plan cache names its shards with an id of its own,
see ``writer._claim_shard_id``; the reader finds the directory from the shard name either
way). Ranks on one node may share a tier: shard names carry the rank, descriptors too.

The writer moves each spool file here once its upload succeeded (``rename``; a copy when
the tier is on another filesystem), then writes the rank's descriptor (``{url, save_key,
rank, created, files: {relative: size}}``) with ``os.replace``, so a directory whose
descriptor is missing is never read. Whether the save committed is not recorded here:
the reader only ever looks for the files the committed manifest in the store names, at the
sizes it names, and checks every byte against the manifest's CRC32C (bytes from local disk
are as untrusted as bytes from the store). A failure in the tier never fails a save.

A **local-only** save (``Checkpointer.save(..., local_only=True)``) goes nowhere else: every
rank writes its shard files here, then the coordinator's ``.metadata`` and manifest (the same
bytes on every rank), then its descriptor, which also records ``local_only: {save_id,
manifest_sha256, world}``. :func:`find_local_only` lists such saves for a restore; each is
checked (descriptor, ``.metadata`` with the restricted unpickler, manifest and its SHA-256)
before it counts, and each byte read later is checked against that manifest's CRC32C.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from dcp_volumes import _layout, errors
from dcp_volumes._manifest import Manifest, load_metadata, volume_save_id
from dcp_volumes.backends import redact_url
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.transfer.readplan import DirectTarget, Need, check_need, describe, plan_ranges

__all__ = ["LocalCommit", "LocalFile", "LocalOnlyCopy", "LocalRead", "OwnCopy", "TierReplica",
           "TierSave", "apply_retention", "find_local", "find_local_only", "own_copy",
           "read_local", "read_span", "url_key"]

logger = logging.getLogger(__name__)

DESCRIPTOR_PREFIX = ".dcpv-tier-"
#: a descriptor larger than this is not a descriptor (a rank lists a few files)
DESCRIPTOR_MAX = 1 << 20
#: a save directory with no descriptor this old is what a killed save left: removed
STALE_S = 3600.0
_URL_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_SAVE_KEY_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{12}$")
_DESCRIPTOR_RE = re.compile(rf"^{re.escape(DESCRIPTOR_PREFIX)}(\d+)\.json$")
#: the largest local ``.metadata`` / manifest read (as for the store's, see ``_commit``)
MAX_COMMIT_FILE = 1 << 30


@dataclass(frozen=True)
class LocalCommit:
    """What commits a local-only save in each rank's tier: the coordinator's bytes."""

    save_id: str
    metadata: bytes
    manifest: bytes

    @property
    def manifest_sha256(self) -> str:
        return hashlib.sha256(self.manifest).hexdigest()


def normal_url(url: str) -> str:
    return redact_url(os.fspath(url)).rstrip("/")


def url_key(url: str) -> str:
    """The directory name of a checkpoint URL's saves in the tier."""
    return hashlib.sha256(normal_url(url).encode()).hexdigest()[:16]


def descriptor_name(rank: int) -> str:
    return f"{DESCRIPTOR_PREFIX}{rank}.json"


# ---- saving -----------------------------------------------------------------------------

class TierSave:
    """One rank's files of one save going into the tier.

    Every method swallows filesystem errors: the first one is logged as a WARNING, what was
    moved so far is removed, and the save goes on (it is durable in the store regardless).
    """

    def __init__(self, options: LocalTierOptions, url: str, save_key: str, rank: int) -> None:
        self.options = options
        self.root = options.resolved_directory()
        self.url = normal_url(url)
        self.save_key = save_key
        self.rank = rank
        self.dir = os.path.join(self.root, url_key(url), save_key)
        self.files: dict[str, int] = {}
        self.ok = True

    def admit(self, nbytes: int) -> bool:
        """Whether this rank's ``nbytes`` can be kept at all (the byte budget)."""
        limit = self.options.max_bytes
        if self.ok and limit is not None and nbytes > limit:
            logger.warning("rank %d: this save's %d bytes exceed LocalTierOptions.max_bytes "
                           "(%d): not kept in the local tier", self.rank, nbytes, limit)
            self.ok = False
        return self.ok

    def keep(self, source: str, relative: str, size: int, *, sync: bool = False) -> None:
        """Move the spooled file ``source`` (uploaded in full) into the tier; ``sync``: make
        its bytes durable on local disk first (a local-only save has no other copy)."""
        if not self.ok:
            return
        try:
            if sync:
                fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            dest = os.path.join(self.dir, _layout.check_relative_path(relative))
            try:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            except FileNotFoundError:  # another rank's retention pruned a parent meanwhile
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                os.rename(source, dest)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                _copy(source, dest)
            self.files[relative] = size
        except (OSError, errors.UnsafeCheckpointError) as exc:
            self._give_up(exc)

    def complete(self, local_only: LocalCommit | None = None, world: int = 0) -> int:
        """Write this rank's descriptor (the files are complete), then apply retention.
        With ``local_only``, the save's ``.metadata`` and manifest are written first and the
        descriptor says so (``world``: the ranks that saved). Returns the bytes kept."""
        if not self.ok or (not self.files and local_only is None):
            return 0
        doc: dict[str, object] = {"format": 1, "url": self.url, "save_key": self.save_key,
                                  "rank": self.rank, "created": time.time(),
                                  "files": self.files}
        path = os.path.join(self.dir, descriptor_name(self.rank))
        try:
            if local_only is not None:
                os.makedirs(self.dir, exist_ok=True)
                _write_atomic(os.path.join(self.dir, _layout.METADATA), local_only.metadata)
                _write_atomic(os.path.join(self.dir, _layout.manifest_name(local_only.save_id)),
                              local_only.manifest)
                doc["local_only"] = {"save_id": local_only.save_id, "world": world,
                                     "manifest_sha256": local_only.manifest_sha256}
            _write_atomic(path, json.dumps(doc).encode())
        except OSError as exc:
            self._give_up(exc)
            return 0
        kept = sum(self.files.values())
        try:
            apply_retention(self.options)
        except OSError as exc:
            logger.warning("rank %d: local tier retention in %s failed (%s); the save is kept",
                           self.rank, self.root, exc.strerror or type(exc).__name__)
        return kept

    def abandon(self) -> None:
        """Remove what this rank moved into the tier (its save failed)."""
        for relative in self.files:
            path = os.path.join(self.dir, relative)
            _unlink_quietly(path)
            _remove_empty_dirs(os.path.dirname(path), self.root)
        self.files.clear()
        self.ok = False

    def _give_up(self, exc: BaseException) -> None:
        what = getattr(exc, "strerror", None) or type(exc).__name__
        logger.warning("rank %d: keeping the save in the local tier %s failed (%s): it is "
                       "durable in the store, loads will read it from there", self.rank,
                       self.root, what)
        self.abandon()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _copy(source: str, dest: str) -> None:
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        shutil.copyfile(source, tmp, follow_symlinks=False)
        os.replace(tmp, dest)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _unlink_quietly(source)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove_empty_dirs(directory: str, root: str) -> None:
    """Remove ``directory`` and its parents up to (not including) ``root`` while empty."""
    directory = os.path.abspath(directory)
    while directory.startswith(root + os.sep):
        try:
            os.rmdir(directory)
        except OSError:
            return
        directory = os.path.dirname(directory)


def _scandir(directory: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(directory))
    except OSError:
        return []


# ---- partner replicas ---------------------------------------------------------------------

@dataclass(frozen=True)
class OwnCopy:
    """This rank's own files of one save in its tier (from its descriptor), as sent to its
    partner: ``files`` are listed in the descriptor, ``extras`` (a local-only save's
    ``.metadata`` and manifest) are not."""

    url: str
    save_key: str
    rank: int
    files: tuple[tuple[str, int], ...]
    extras: tuple[tuple[str, int], ...] = ()
    local_only: tuple[str, int, str] | None = None

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files + self.extras)


def own_copy(options: LocalTierOptions, url: str, rank: int) -> OwnCopy | None:
    """The newest copy of ``url`` this rank kept itself (not a replica), or None."""
    root = os.path.realpath(options.resolved_directory())
    normal = normal_url(url)
    best: tuple[float, str, _Descriptor] | None = None
    for sdir in _scandir(os.path.join(root, url_key(url))):
        if not (_SAVE_KEY_RE.match(sdir.name) and sdir.is_dir(follow_symlinks=False)):
            continue
        d = _read_descriptor(os.path.join(sdir.path, descriptor_name(rank)), normal, sdir.name)
        if d is not None and d.rank == rank and not d.replica and (
                best is None or d.created > best[0]):
            best = (d.created, sdir.name, d)
    if best is None:
        return None
    _, key, d = best
    extras: list[tuple[str, int]] = []
    if d.local_only is not None:
        for name in (_layout.METADATA, _layout.manifest_name(d.local_only[0])):
            try:
                extras.append((name, os.lstat(os.path.join(root, url_key(url), key, name))
                               .st_size))
            except OSError:
                return None
    return OwnCopy(normal, key, rank, tuple(sorted(d.files.items())), tuple(extras),
                   d.local_only)


def open_own(options: LocalTierOptions, copy: OwnCopy, relative: str) -> int:
    """A read-only descriptor of one of ``copy``'s files (no link followed)."""
    path = os.path.join(os.path.realpath(options.resolved_directory()), url_key(copy.url),
                        copy.save_key, _layout.check_relative_path(relative))
    return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))


class TierReplica:
    """A partner rank's files of one save arriving into this node's tier, chunk by chunk.

    Files are written under temporary names and renamed when complete; the descriptor (the
    partner's, marked ``replica``) is written last, by :meth:`complete`. Every method
    swallows filesystem errors: the first is logged as a WARNING and what arrived is removed.
    Nothing here is trusted at read: a replica is checked against the committed manifest's
    sizes and CRC32C like any local copy.
    """

    def __init__(self, options: LocalTierOptions, copy: OwnCopy, me: int) -> None:
        self.options = options
        self.copy = copy
        self.me = me
        self.root = os.path.realpath(options.resolved_directory())
        self.dir = os.path.join(self.root, url_key(copy.url), copy.save_key)
        self.ok = _URL_KEY_RE.match(url_key(copy.url)) is not None and \
            _SAVE_KEY_RE.match(copy.save_key) is not None
        self.written: list[str] = []
        self._fd: int | None = None
        self._tmp = ""
        self._dest = ""
        limit = options.max_bytes
        if self.ok and limit is not None and copy.nbytes > limit:
            logger.warning("rank %d: rank %d's %d bytes exceed LocalTierOptions.max_bytes "
                           "(%d): no partner replica kept", me, copy.rank, copy.nbytes, limit)
            self.ok = False

    def begin(self, relative: str) -> None:
        if not self.ok:
            return
        try:
            self._dest = os.path.join(self.dir, _layout.check_relative_path(relative))
            os.makedirs(os.path.dirname(self._dest), exist_ok=True)
            self._tmp = f"{self._dest}.tmp-{os.getpid()}"
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                               | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except (OSError, errors.UnsafeCheckpointError) as exc:
            self._give_up(exc)

    def write(self, data: memoryview) -> None:
        if not self.ok or self._fd is None:
            return
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            self._give_up(exc)

    def end(self) -> None:
        if not self.ok or self._fd is None:
            return
        try:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self._dest)
            self.written.append(self._dest)
        except OSError as exc:
            self._give_up(exc)

    def complete(self, sender_ok: bool) -> int:
        """Write the partner's descriptor (when its files all arrived and ``sender_ok``),
        then apply retention. Returns the bytes kept."""
        if not (self.ok and sender_ok):
            self.abandon()
            return 0
        c = self.copy
        doc: dict[str, object] = {"format": 1, "url": c.url, "save_key": c.save_key,
                                  "rank": c.rank, "created": time.time(),
                                  "files": dict(c.files), "replica": {"held_by": self.me}}
        if c.local_only is not None:
            sid, world, sha = c.local_only
            doc["local_only"] = {"save_id": sid, "world": world, "manifest_sha256": sha}
        try:
            _write_atomic(os.path.join(self.dir, descriptor_name(c.rank)),
                          json.dumps(doc).encode())
        except OSError as exc:
            self._give_up(exc)
            return 0
        try:
            apply_retention(self.options)
        except OSError as exc:
            logger.warning("rank %d: local tier retention in %s failed (%s)", self.me,
                           self.root, exc.strerror or type(exc).__name__)
        return c.nbytes

    def abandon(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp:
            _unlink_quietly(self._tmp)
        extras = {os.path.join(self.dir, name) for name, _ in self.copy.extras}
        for path in self.written:
            if path not in extras:  # the save's own commit files may be this rank's too
                _unlink_quietly(path)
                _remove_empty_dirs(os.path.dirname(path), self.root)
        self.written.clear()
        self.ok = False

    def _give_up(self, exc: BaseException) -> None:
        if self.ok:
            what = getattr(exc, "strerror", None) or type(exc).__name__
            logger.warning("rank %d: keeping rank %d's partner replica in the local tier %s "
                           "failed (%s): that rank's copy is in the store or its own tier "
                           "only", self.me, self.copy.rank, self.root, what)
        self.abandon()


# ---- descriptors and retention ----------------------------------------------------------

@dataclass
class _Descriptor:
    rank: int
    created: float
    files: dict[str, int]
    url: str = ""
    local_only: tuple[str, int, str] | None = None  # save id, world, manifest sha256
    replica: bool = False  # a partner rank's files, kept here by this node (see _replicate)


def _read_descriptor(path: str, url: str | None, save_key: str) -> _Descriptor | None:
    """A descriptor, or None when it is not a well-formed one of ``save_key`` (and ``url``,
    when given). Untrusted: a regular file of bounded size, every field checked."""
    raw = _read_bounded(path, DESCRIPTOR_MAX)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        files = doc["files"]
        rank, created = doc["rank"], doc["created"]
        if (
            not isinstance(files, dict) or doc.get("save_key") != save_key
            or (url is not None and doc.get("url") != url)
            or isinstance(rank, bool) or not isinstance(rank, int)
            or isinstance(created, bool) or not isinstance(created, (int, float))
        ):
            return None
        out: dict[str, int] = {}
        for rel, size in files.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                return None
            out[_layout.check_relative_path(rel)] = size
        lo = doc.get("local_only")
        local_only = None
        if lo is not None:
            sid, lworld, sha = lo["save_id"], lo["world"], lo["manifest_sha256"]
            if (not _layout.is_save_id(sid) or isinstance(lworld, bool)
                    or not isinstance(lworld, int) or not 0 <= rank < lworld
                    or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha)):
                return None
            local_only = (sid, lworld, sha)
        durl = doc.get("url")
        if not isinstance(durl, str):
            return None
    except (ValueError, KeyError, TypeError, AttributeError, errors.UnsafeCheckpointError):
        return None
    return _Descriptor(rank, float(created), out, durl, local_only,
                       doc.get("replica") is not None)


def _descriptors(save_dir: str, url: str | None, save_key: str) -> list[_Descriptor]:
    out = []
    for entry in _scandir(save_dir):
        if _DESCRIPTOR_RE.match(entry.name):
            d = _read_descriptor(entry.path, url, save_key)
            if d is not None:
                out.append(d)
    return out


@dataclass
class _Save:
    path: str
    created: float
    nbytes: int


def apply_retention(options: LocalTierOptions) -> list[str]:
    """Evict the oldest saves of the whole tier directory beyond ``keep_last`` saves or
    ``max_bytes`` bytes (a save is older when its newest descriptor is). Directories that
    have no descriptor and are older than :data:`STALE_S` (a killed save) are removed too.
    Returns the save directories removed."""
    root = options.resolved_directory()
    saves: list[_Save] = []
    removed: list[str] = []
    now = time.time()
    for udir in _scandir(root):
        if not (_URL_KEY_RE.match(udir.name) and udir.is_dir(follow_symlinks=False)):
            continue
        for sdir in _scandir(udir.path):
            if not (_SAVE_KEY_RE.match(sdir.name) and sdir.is_dir(follow_symlinks=False)):
                continue
            descs = _descriptors(sdir.path, None, sdir.name)
            if descs:
                saves.append(_Save(sdir.path, max(d.created for d in descs),
                                   sum(s for d in descs for s in d.files.values())))
            else:
                try:
                    stale = now - sdir.stat(follow_symlinks=False).st_mtime > STALE_S
                except OSError:
                    continue
                if stale:
                    shutil.rmtree(sdir.path, ignore_errors=True)
                    removed.append(sdir.path)
    saves.sort(key=lambda s: s.created, reverse=True)
    total, over = 0, False
    for i, s in enumerate(saves):
        over = over or (options.keep_last is not None and i >= options.keep_last) or (
            options.max_bytes is not None and total + s.nbytes > options.max_bytes)
        if over:
            shutil.rmtree(s.path, ignore_errors=True)
            removed.append(s.path)
        else:
            total += s.nbytes
    for path in removed:
        _remove_empty_dirs(os.path.dirname(path), root)
    if removed:
        logger.debug("local tier %s: removed %d saves", root, len(removed))
    return removed


# ---- loading ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalFile:
    """A shard file of the committed save found in the tier at the size the manifest says."""

    path: str
    size: int


def find_local(options: LocalTierOptions, url: str, manifest: Manifest
               ) -> tuple[dict[str, LocalFile], dict[str, str]]:
    """The committed save's shard files this node's tier holds, by relative path, and those
    a descriptor lists but that cannot be used (with why): missing, a link, not a regular
    file, or of another size than the manifest's. Only files the committed ``manifest``
    names are looked for, in the directory of the id in their name."""
    root = os.path.realpath(options.resolved_directory())
    usable: dict[str, LocalFile] = {}
    rejected: dict[str, str] = {}
    if not os.path.isdir(root):
        return usable, rejected
    base = os.path.join(root, url_key(url))
    listed_by_key: dict[str, dict[str, int]] = {}
    normal = normal_url(url)
    for relative, entry in manifest.files.items():
        key = _layout.save_id_of(relative)
        if key is None:
            continue
        if key not in listed_by_key:
            listed: dict[str, int] = {}
            for d in _descriptors(os.path.join(base, key), normal, key):
                listed.update(d.files)
            listed_by_key[key] = listed
        size = listed_by_key[key].get(relative)
        if size is None:
            continue  # not kept on this node
        path = os.path.join(base, key, relative)
        why = _unusable(path, entry.size) if size == entry.size else (
            f"its descriptor says {size} bytes, the committed manifest {entry.size}")
        if why is None:
            usable[relative] = LocalFile(path, entry.size)
        else:
            rejected[relative] = why
    return usable, rejected


def _unusable(path: str, size: int) -> str | None:
    """Why the file at ``path`` cannot stand for a shard of ``size`` bytes, or None."""
    if os.path.realpath(path) != path:
        return "a symbolic link is on its path"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_size != size:
        return f"it has {st.st_size} bytes, the committed manifest says {size}"
    return None


@dataclass
class LocalRead:
    """What :func:`read_local` did: bytes used, and the needs the store must serve instead."""

    bytes_used: int = 0
    fallback: list[Need] = field(default_factory=list)


def read_local(needs: list[Need], files: dict[str, LocalFile], *, gap: int, max_size: int,
               url: str, apply: Callable[[Need, memoryview], None],
               direct: Callable[[Need], DirectTarget | None] | None = None,
               commit: Callable[[DirectTarget], None] | None = None) -> LocalRead:
    """Read ``needs`` (all in ``files``) from local disk, checking each against its CRC32C
    exactly as a store read is checked; ``apply`` gets the bytes of each need that passed.
    A file that cannot be opened, changed size, or bytes that fail their checksum are never
    applied: those needs are returned for the store, each logged as a WARNING.

    ``direct``: where it gives a need's :class:`DirectTarget` covering exactly the need's
    bytes (a whole contiguous tensor), they are read straight into the target's memory and
    checked there, saving a copy, and ``commit`` is called with it; a failed check leaves
    them to the store, which overwrites them (the target is the caller's to fill either
    way)."""
    out = LocalRead()
    rest: list[Need] = []
    into: list[tuple[Need, DirectTarget]] = []
    for need in needs:
        target = direct(need) if direct is not None else None
        if target is None or (target.start, target.end) != (need.start, need.end):
            rest.append(need)
        else:
            into.append((need, target))
    # Reads and checksums release the GIL: a few threads overlap one file's read with
    # another's CRC32C. The targets are disjoint; ``commit`` runs here, in order.
    workers = min(len(into), _READ_THREADS)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers, "dcpv-tier-read") as pool:
            done = list(pool.map(lambda nt: _read_into(nt[0], files[nt[0].relative], nt[1],
                                                       url), into))
    else:
        done = [_read_into(n, files[n.relative], t, url) for n, t in into]
    for (need, target), ok in zip(into, done):
        if ok:
            if commit is not None:
                commit(target)
            out.bytes_used += need.end - need.start
        else:
            out.fallback.append(need)
    for rng in plan_ranges(rest, gap=gap, max_size=max_size):
        local = files[rng.relative]
        data: bytes | None = None
        why = ""
        try:
            data = read_span(local, rng.start, rng.end)
        except OSError as exc:
            why = _why(exc)
        if data is None:
            _warn_fallback(rng.relative, url, why, len(rng.items))
            out.fallback.extend(rng.items)
            continue
        view = memoryview(data)
        for need in rng.items:
            chunk = view[need.start - rng.start:need.end - rng.start]
            if not _checked(need, chunk, rng.relative, url):
                out.fallback.append(need)
                continue
            apply(need, chunk)
            out.bytes_used += len(chunk)
    return out


def _checked(need: Need, chunk: memoryview, relative: str, url: str) -> bool:
    try:
        check_need(need, chunk, url)
    except errors.IntegrityError:
        logger.warning("local copy of shard %s of %s: %s fails its checksum; reading it from "
                       "the store", relative, url, describe(need.reads[0]))
        return False
    return True


def _read_into(need: Need, local: LocalFile, target: DirectTarget, url: str) -> bool:
    """Read ``need``'s bytes from ``local`` straight into ``target`` and check them there."""
    view = target.view.numpy().data
    try:
        _open_checked(local, lambda fd: _preadv_all(fd, view, need.start))
    except OSError as exc:
        _warn_fallback(need.relative, url, _why(exc), 1)
        return False
    return _checked(need, view, need.relative, url)


def _why(exc: OSError) -> str:
    """Why a local file could not be read, as the fallback warning says it."""
    if exc.errno == errno.EIO and str(exc.strerror).startswith("it "):
        return str(exc.strerror)  # ours: it changed / is shorter than expected
    return f"it cannot be read ({exc.strerror})"


def _preadv_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "it is shorter than expected")
        done += n


def _warn_fallback(relative: str, url: str, why: str, count: int) -> None:
    logger.warning("local copy of shard %s of %s is not used: %s; reading %d items from the "
                   "store", relative, url, why, count)


_T = TypeVar("_T")
#: threads reading whole tensors from the tier into their targets
_READ_THREADS = max(2, min(4, os.cpu_count() or 1))


def _open_checked(local: LocalFile, use: Callable[[int], _T]) -> _T:
    """``use`` an open descriptor of a local shard file (a regular file, no link, still of
    the size it was found at). Raises ``OSError`` when it is not that."""
    fd = os.open(local.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != local.size:
            raise OSError(errno.EIO, f"it changed (now {st.st_size} bytes, expected "
                          f"{local.size})")
        return use(fd)
    finally:
        os.close(fd)


def read_span(local: LocalFile, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a local shard file (a regular file, no link, still of the
    size it was found at). Raises ``OSError`` when they cannot be read in full."""
    data = _open_checked(local, lambda fd: os.pread(fd, end - start, start))
    if len(data) != end - start:
        raise OSError(errno.EIO, "it is shorter than expected")
    return data


# ---- local-only saves ---------------------------------------------------------------------

@dataclass(frozen=True)
class LocalOnlyCopy:
    """One rank's descriptor of a local-only save found (and checked) in this node's tier.
    ``commit`` (the ``.metadata`` and manifest bytes) stays on the rank that read it."""

    url: str
    save_id: str
    rank: int
    world: int
    manifest_sha256: str
    created: float
    commit: LocalCommit | None = field(default=None, compare=False, repr=False)

    def key(self) -> tuple[str, str, str, int]:
        """What every rank's descriptor of one save has in common."""
        return self.url, self.save_id, self.manifest_sha256, self.world

    def without_commit(self) -> LocalOnlyCopy:
        return LocalOnlyCopy(self.url, self.save_id, self.rank, self.world,
                             self.manifest_sha256, self.created)


def _read_bounded(path: str, limit: int) -> bytes | None:
    """A regular file's bytes (no link, at most ``limit`` of them), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
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


def _check_commit(save_dir: str, save_id: str, world: int, sha: str) -> LocalCommit | None:
    """The ``.metadata`` and manifest of a local-only save in ``save_dir``, when they are
    what its descriptor says: a manifest with that SHA-256, save id and world size, and a
    ``.metadata`` that the restricted unpickler accepts and that commits that save id."""
    manifest_bytes = _read_bounded(os.path.join(save_dir, _layout.manifest_name(save_id)),
                                   MAX_COMMIT_FILE)
    if manifest_bytes is None or hashlib.sha256(manifest_bytes).hexdigest() != sha:
        return None
    metadata_bytes = _read_bounded(os.path.join(save_dir, _layout.METADATA), MAX_COMMIT_FILE)
    if metadata_bytes is None:
        return None
    where = os.path.join(save_dir, _layout.METADATA)
    try:
        manifest = Manifest.from_json(manifest_bytes, where=where)
        metadata = load_metadata(metadata_bytes, where=where)
    except errors.DCPVolumesError as exc:
        logger.warning("local-only save %s in %s is not used: %s", save_id, save_dir, exc)
        return None
    if manifest.save_id != save_id or manifest.world_size != world or \
            volume_save_id(metadata) != save_id:
        logger.warning("local-only save %s in %s is not used: its .metadata or manifest "
                       "belongs to another save", save_id, save_dir)
        return None
    return LocalCommit(save_id, metadata_bytes, manifest_bytes)


def find_local_only(options: LocalTierOptions, wanted: Callable[[str], bool]
                    ) -> list[LocalOnlyCopy]:
    """Every rank descriptor of a local-only save in this node's tier whose checkpoint URL
    ``wanted`` accepts, with its save's ``.metadata`` and manifest checked (see
    :func:`_check_commit`). Descriptors whose URL does not hash to their directory, or whose
    files are missing or damaged, are left out."""
    root = os.path.realpath(options.resolved_directory())
    out: list[LocalOnlyCopy] = []
    for udir in _scandir(root):
        if not (_URL_KEY_RE.match(udir.name) and udir.is_dir(follow_symlinks=False)):
            continue
        for sdir in _scandir(udir.path):
            if not (_SAVE_KEY_RE.match(sdir.name) and sdir.is_dir(follow_symlinks=False)):
                continue
            checked: dict[tuple[str, int, str], LocalCommit | None] = {}
            for d in _descriptors(sdir.path, None, sdir.name):
                if d.local_only is None or url_key(d.url) != udir.name or not wanted(d.url):
                    continue
                if d.local_only not in checked:
                    checked[d.local_only] = _check_commit(sdir.path, *d.local_only)
                commit = checked[d.local_only]
                if commit is None:
                    continue
                sid, world, sha = d.local_only
                if any(_unusable(os.path.join(sdir.path, rel), size) is not None
                       for rel, size in d.files.items()):
                    logger.warning("local-only save %s of %s: rank %d's files in %s are "
                                   "missing or damaged; not used", sid, d.url, d.rank,
                                   sdir.path)
                    continue
                out.append(LocalOnlyCopy(d.url, sid, d.rank, world, sha, d.created, commit))
    return out
