"""The checkpoints of a run: list, latest, retention, verify, describe, remove, gc.

A run keeps its checkpoints under one root, one directory (prefix) per checkpoint::

    s3://bucket/run-42/
      step-00001000/   .metadata, .dcpv-manifest-<id>.json, __<rank>_<i>-<id>.distcp
      step-00002000/   (no .metadata: incomplete -- being written, or killed)

Listing costs **one** recursive listing of the root (a paginated LIST of the prefix on object
stores: one request per 1000 objects), grouped by the first path component -- never one LIST
per checkpoint, so it stays cheap with thousands of checkpoints. :func:`latest` lists on one
rank and broadcasts the answer. Every backend call goes through :class:`~dcp_volumes._fs.Backend`
so errors are translated in one place.

Importing this module does not import torch; only :func:`verify`, :func:`describe` and
:func:`gc` (which unpickle ``.metadata``) and a distributed :func:`latest` do.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_volumes import _layout, errors
from dcp_volumes._fs import Backend, open_backend, redact_url
from dcp_volumes.config import RetryOptions

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_volumes._manifest import Manifest

__all__ = [
    "DEFAULT_STEP_PATTERN",
    "CheckpointDetails",
    "CheckpointInfo",
    "EntryInfo",
    "FileReport",
    "GcReport",
    "VerifyReport",
    "apply_retention",
    "describe",
    "gc",
    "latest",
    "list_checkpoints",
    "listings_made",
    "remove",
    "verify",
]

logger = logging.getLogger(__name__)

#: Matches ``step-<N>``, ``step_<N>`` and ``<N>`` (the whole directory name).
DEFAULT_STEP_PATTERN = r"^(?:step[-_])?(?P<step>\d+)$"

#: ``progress(done, total)``: bytes verified or objects removed so far, out of ``total``.
Progress = Callable[[int, int], None]

_CLOUD = frozenset({"s3", "gcs", "azure"})
_TORCH_SHARD_RE = re.compile(r"^__\d+_\d+\.distcp$")
_TMP_RE = re.compile(r"^\.metadata(?:\..+)?\.tmp$")
_RANK_RE = re.compile(r"^__(\d+)_\d+")

# Root listings made by this process (see listings_made()).
_listings = 0
_listings_lock = threading.Lock()


def listings_made() -> int:
    """How many recursive root listings this process has made through the catalog.

    Each is one paginated LIST of the prefix. Tests use it to prove that :func:`latest` on N
    ranks lists once in total, not once per rank.
    """
    with _listings_lock:
        return _listings


def _count_listing() -> None:
    global _listings
    with _listings_lock:
        _listings += 1


# --------------------------------------------------------------------------------------------
# Listing


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint under a run root, as one listing sees it.

    Attributes:
        url: the checkpoint's URL (root URL + ``/`` + ``name``).
        name: the directory name under the root, e.g. ``"step-00001000"``.
        step: the step parsed from ``name`` by the step pattern; ``None`` if it does not match.
        complete: ``.metadata`` exists (the save committed).
        bytes: total size of its objects.
        objects: number of its objects.
        commit_time: epoch seconds when ``.metadata`` was written (its modification time, else
            the timestamp in the newest save id); ``None`` when incomplete or unknown.
        last_modified: epoch seconds of its newest object (``None`` if the store gives none).
    """

    url: str
    name: str
    step: int | None
    complete: bool
    bytes: int
    objects: int
    commit_time: float | None
    last_modified: float | None

    @property
    def status(self) -> str:
        """``"complete"`` or ``"incomplete"``."""
        return "complete" if self.complete else "incomplete"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus ``status``."""
        doc = asdict(self)
        doc["status"] = self.status
        return doc


@dataclass(frozen=True)
class _Object:
    name: str  # relative to the directory that was listed (or to its checkpoint, once grouped)
    size: int
    mtime: float | None


def _open(url: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Backend:
    if storage_options is not None and not isinstance(storage_options, dict):
        raise errors.ConfigError("storage_options must be a dict of fsspec options or None")
    return open_backend(os.fspath(url), storage_options, RetryOptions())


def _compile(step_pattern: str | re.Pattern[str] | None) -> re.Pattern[str]:
    if step_pattern is None:
        step_pattern = DEFAULT_STEP_PATTERN
    if isinstance(step_pattern, re.Pattern):
        return step_pattern
    try:
        return re.compile(step_pattern)
    except re.error as exc:
        raise errors.ConfigError(
            f"step pattern {step_pattern!r} is not a valid regular expression ({exc}); "
            r"use e.g. '^step-(?P<step>\d+)$'"
        ) from None


def _step_of(name: str, pattern: re.Pattern[str]) -> int | None:
    m = pattern.search(name)
    if m is None:
        return None
    if "step" in pattern.groupindex:
        text = m.group("step")
    elif pattern.groups:
        text = m.group(1)
    else:
        text = m.group(0)
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _to_epoch(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, str):
        try:
            return _to_epoch(_dt.datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


def _mtime(info: dict[str, Any]) -> float | None:
    # local: mtime; s3: LastModified; azure: last_modified; gcs: updated; memory: created
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        t = _to_epoch(info.get(key))
        if t is not None:
            return t
    return None


def _save_id_time(save_id: str | None) -> float | None:
    if save_id is None or not _layout.is_save_id(save_id):
        return None
    return float(int(save_id[:8], 16))  # the first 8 hex digits are epoch seconds


def _is_artifact(name: str) -> bool:
    """A file DCP (torch's writers or ours) writes into a checkpoint directory."""
    return (
        name == _layout.METADATA
        or _layout.save_id_of(name) is not None
        or _TORCH_SHARD_RE.match(name) is not None
        or _TMP_RE.match(name) is not None
    )


async def _scan(backend: Backend) -> list[_Object]:
    """Every object under the backend's root, in one recursive listing."""
    _count_listing()
    backend.fs.invalidate_cache(backend.root)
    try:
        found = await backend.call(
            lambda: backend.fs_call("find", backend.root, detail=True), op="list", url=backend.url
        )
    except errors.ObjectNotFoundError:
        found = {}
    prefix = backend.root.rstrip("/") + "/"
    out: list[_Object] = []
    for path, info in dict(found).items():
        path = str(path)
        if not path.startswith(prefix) or info.get("type", "file") != "file":
            continue
        rel = path[len(prefix) :]
        if rel and not rel.endswith("/"):
            out.append(_Object(rel, int(info.get("size") or 0), _mtime(info)))
    if not out and backend.kind in _CLOUD:
        # An empty prefix is fine, a missing bucket is not: say which it is.
        await backend.check_bucket()
    return out


def _group(objects: Iterable[_Object]) -> dict[str, list[_Object]]:
    """Group objects by their first path component (objects right under the root: dropped)."""
    groups: dict[str, list[_Object]] = {}
    for o in objects:
        head, sep, rest = o.name.partition("/")
        if sep and rest:
            groups.setdefault(head, []).append(_Object(rest, o.size, o.mtime))
    return groups


def _describe_group(
    base_url: str, name: str, objects: list[_Object], pattern: re.Pattern[str]
) -> CheckpointInfo:
    meta = next((o for o in objects if o.name == _layout.METADATA), None)
    ids = sorted({sid for o in objects if (sid := _layout.save_id_of(o.name)) is not None})
    newest_id_time = _save_id_time(ids[-1]) if ids else None
    commit_time = None
    if meta is not None:
        commit_time = meta.mtime if meta.mtime is not None else newest_id_time
    mtimes = [o.mtime for o in objects if o.mtime is not None]
    return CheckpointInfo(
        url=f"{base_url}/{name}",
        name=name,
        step=_step_of(name, pattern),
        complete=meta is not None,
        bytes=sum(o.size for o in objects),
        objects=len(objects),
        commit_time=commit_time,
        last_modified=max(mtimes) if mtimes else newest_id_time,
    )


def _catalog(
    backend: Backend, groups: dict[str, list[_Object]], pattern: re.Pattern[str]
) -> list[CheckpointInfo]:
    infos = [
        _describe_group(backend.url, name, objs, pattern)
        for name, objs in groups.items()
        # A directory is a checkpoint if its name is a step or it holds DCP files; `logs/` is not.
        if _step_of(name, pattern) is not None or any(_is_artifact(o.name) for o in objs)
    ]
    infos.sort(key=lambda i: (i.step is None, i.step if i.step is not None else 0, i.name))
    return infos


def list_checkpoints(
    root: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
) -> list[CheckpointInfo]:
    """The checkpoints under a run root, complete or not, sorted by step then name.

    One recursive listing of ``root`` (one paginated LIST on object stores), grouped by the
    first path component. A directory counts as a checkpoint when its name matches
    ``step_pattern`` or it holds DCP files (``.metadata``, ``*.distcp``, a manifest).

    Args:
        root: the run root, e.g. ``"s3://bucket/run-42/"`` or a local directory. On object
            stores it must name a prefix inside the bucket.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: regular expression that extracts the step from a directory name: the
            group named ``step``, else the first group, else the whole match. Default
            :data:`DEFAULT_STEP_PATTERN` (``step-<N>``, ``step_<N>``, ``<N>``).

    Raises:
        BucketNotFoundError: the bucket or container does not exist.
        StoragePermissionError: the store refused the listing.
    """
    pattern = _compile(step_pattern)
    backend = _open(root, storage_options)
    objects = backend.run(lambda: _scan(backend))
    return _catalog(backend, _group(objects), pattern)


# --------------------------------------------------------------------------------------------
# Latest


def _newest_complete(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
    complete = [i for i in infos if i.complete]
    stepped = [i for i in complete if i.step is not None]
    if stepped:
        return max(stepped, key=lambda i: (i.step, i.commit_time or 0.0, i.name))
    if complete:
        return max(complete, key=lambda i: (i.commit_time or 0.0, i.name))
    return None


def _distributed(process_group: ProcessGroup | None) -> bool:
    if process_group is not None:
        return True
    if "torch.distributed" not in sys.modules:
        return False  # nobody imported it, so nobody initialized it: stay torch-free
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def latest(
    root: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    process_group: ProcessGroup | None = None,
) -> CheckpointInfo | None:
    """The newest *complete* checkpoint under ``root`` (highest step), or ``None``.

    When torch.distributed is initialized (or ``process_group`` is given), only rank 0 of the
    group lists the root and the answer -- or its error -- is broadcast with
    ``dist.broadcast_object_list``: one LIST per job, not one per rank. Every rank of the group
    must call it. With NCCL as the default group, pass a gloo ``process_group``.

    Args:
        root: the run root.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: as for :func:`list_checkpoints`.
        process_group: the group to broadcast over (default: the default group).
    """
    if not _distributed(process_group):
        return _newest_complete(
            list_checkpoints(root, storage_options=storage_options, step_pattern=step_pattern)
        )
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank(process_group) == 0:
        try:
            box[0] = (
                True,
                _newest_complete(
                    list_checkpoints(
                        root, storage_options=storage_options, step_pattern=step_pattern
                    )
                ),
            )
        except Exception as exc:  # noqa: BLE001 -- every rank must raise it, not hang
            box[0] = (False, exc)
    dist.broadcast_object_list(box, group_src=0, group=process_group)
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Removal and retention


async def _delete_checkpoint(backend: Backend, prefix: str, objects: list[_Object]) -> None:
    """``.metadata`` first -- the checkpoint is never visible but partial -- then the rest."""

    def rel(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    names = [o.name for o in objects]
    if _layout.METADATA in names:
        await backend.remove([rel(_layout.METADATA)])
    await backend.remove([rel(n) for n in names if n != _layout.METADATA])
    if backend.kind == "local":
        await _prune_empty_dirs(backend, backend.path(prefix) if prefix else backend.root)


async def _prune_empty_dirs(backend: Backend, top: str) -> None:
    # Local directories outlive their files; remove the empty ones we leave behind.
    dirs = [d for d, _, _ in os.walk(top, topdown=False)]
    for d in dirs:
        try:
            await backend.call(functools.partial(backend.fs_call, "rmdir", d), op="delete", url=d)
        except (errors.DCPVolumesError, OSError):
            pass  # not empty (someone wrote into it): leave it


def _ordered_urls(base: str, objects: list[_Object]) -> list[str]:
    names = sorted((o.name for o in objects), key=lambda n: (n != _layout.METADATA, n))
    return [f"{base}/{n}" for n in names]


def remove(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Remove one checkpoint: ``.metadata`` first, then every other object.

    Refuses anything that does not look like one checkpoint (objects in sub-directories,
    e.g. a run root, or no DCP files at all), so a typo cannot wipe a run.

    Returns:
        The URLs of the objects removed (or that would be, with ``dry_run``), ``.metadata``
        first.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        ConfigError: ``url`` is not a checkpoint directory.
    """
    backend = _open(url, storage_options)
    objects = backend.run(lambda: _scan(backend))
    where = redact_url(backend.url)
    if not objects:
        raise errors.CheckpointNotFoundError(f"no checkpoint at {where}: nothing to remove")
    nested = sorted(o.name for o in objects if "/" in o.name)
    if nested:
        raise errors.ConfigError(
            f"{where} holds sub-directories ({nested[0]}, ...): it looks like a run root, not one "
            "checkpoint; remove checkpoints one at a time"
        )
    if not any(_is_artifact(o.name) for o in objects):
        raise errors.ConfigError(
            f"{where} holds no checkpoint files (.metadata, *.distcp): refusing to remove it"
        )
    urls = _ordered_urls(backend.url, objects)
    if not dry_run:
        backend.run(lambda: _delete_checkpoint(backend, "", objects))
        logger.info("removed %s (%d objects)", where, len(objects))
    return urls


def _retention_victims(
    infos: list[CheckpointInfo], keep_last: int | None, keep_every: int | None
) -> list[CheckpointInfo]:
    if keep_last is None and keep_every is None:
        return []
    # Only complete checkpoints with a step are candidates: an incomplete one may be being
    # written, and one without a step cannot be ordered.
    ordered = sorted(
        (i for i in infos if i.complete and i.step is not None), key=lambda i: (i.step, i.name)
    )
    if not ordered:
        return []
    keep = {ordered[-1].url}  # the newest complete checkpoint, always
    if keep_last is not None:
        keep.update(i.url for i in ordered[-keep_last:])
    if keep_every is not None:
        keep.update(i.url for i in ordered if i.step is not None and i.step % keep_every == 0)
    return [i for i in ordered if i.url not in keep]


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise errors.ConfigError(f"{name} must be a whole number >= 1 or None, got {value!r}")


def apply_retention(
    root: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    storage_options: dict[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Delete the complete checkpoints the policy does not keep.

    Kept: the last ``keep_last`` complete checkpoints, every checkpoint whose step is a
    multiple of ``keep_every``, the newest complete checkpoint (always), every incomplete
    checkpoint (it may be being written; :func:`gc` handles stale ones) and every checkpoint
    whose name has no step. With neither option set nothing is deleted. Each checkpoint is
    deleted ``.metadata`` first, so it is never visible while partially deleted.

    Returns:
        URLs of the checkpoints removed (or that would be, with ``dry_run``), oldest first.
    """
    _check_count("keep_last", keep_last)
    _check_count("keep_every", keep_every)
    pattern = _compile(step_pattern)
    backend = _open(root, storage_options)
    groups = _group(backend.run(lambda: _scan(backend)))
    victims = _retention_victims(_catalog(backend, groups, pattern), keep_last, keep_every)
    if not dry_run:
        for info in victims:
            backend.run(
                functools.partial(_delete_checkpoint, backend, info.name, groups[info.name])
            )
            logger.info("retention removed %s (step %s)", redact_url(info.url), info.step)
    return [i.url for i in victims]


# --------------------------------------------------------------------------------------------
# Reading one checkpoint's .metadata and manifest


async def _read_metadata_bytes(backend: Backend) -> bytes:
    try:
        return await backend.cat(_layout.METADATA, op="read")
    except errors.ObjectNotFoundError:
        names = await backend.list_names()
    where = redact_url(backend.url)
    if names:
        raise errors.IncompleteCheckpointError(
            f"{where} has {len(names)} objects but no .metadata: the save did not commit "
            "(interrupted or still running); `dcp-volumes gc` removes stale leftovers"
        )
    raise errors.CheckpointNotFoundError(f"no checkpoint at {where}")


@dataclass
class _Loaded:
    metadata: Metadata
    save_id: str | None
    ours: bool  # written by VolumeWriter: a manifest is expected
    manifest: Manifest | None
    manifest_problem: str | None
    torch_version: str | None = None


def _load(backend: Backend) -> _Loaded:
    data = backend.run(lambda: _read_metadata_bytes(backend))
    # Only now import torch (unpickling needs it): "not found" answers stay fast.
    from dcp_volumes._manifest import (
        load_metadata,
        metadata_save_id,
        read_manifest,
        volume_save_id,
    )

    metadata = load_metadata(data, where=backend.object_url(_layout.METADATA))
    save_id = volume_save_id(metadata)
    if save_id is None:
        return _Loaded(metadata, metadata_save_id(metadata), False, None, None)
    try:
        manifest = backend.run(lambda: read_manifest(backend, metadata))
    except errors.IntegrityError as exc:
        return _Loaded(metadata, save_id, True, None, str(exc))
    return _Loaded(metadata, save_id, True, manifest, None, (manifest.torch or None)
                   if manifest is not None else None)


# --------------------------------------------------------------------------------------------
# Verify


@dataclass
class FileReport:
    """What :func:`verify` found for one file.

    Attributes:
        name: the file, relative to the checkpoint.
        status: ``"ok"``, ``"missing"``, ``"size mismatch"``, ``"checksum mismatch"`` or
            ``"not in manifest"``.
        expected_size: the size the manifest records (no manifest: the least size the items
            named in ``.metadata`` need).
        actual_size: the stored size, ``None`` when missing.
        bad_items: the items whose checksum or length did not match, described.
    """

    name: str
    status: str
    expected_size: int
    actual_size: int | None = None
    bad_items: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        url: the checkpoint.
        save_id: the committed save's id (``None`` for checkpoints written by torch's writers).
        checksummed: the items' CRC32C were checked (a manifest was there).
        note: what was and was not checked, in words.
        files: one :class:`FileReport` per file.
        bytes_read: bytes read back from the store.
    """

    url: str
    save_id: str | None
    checksummed: bool
    note: str
    files: list[FileReport]
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        """Every file is as recorded."""
        return all(f.ok for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        return doc


def _item_names(metadata: Metadata) -> dict[tuple[str, int], str]:
    out: dict[tuple[str, int], str] = {}
    for index, info in metadata.storage_data.items():
        where = f"{index.fqn!r}" + (f" at {tuple(index.offset)}" if index.offset else "")
        out[(info.relative_path, info.offset)] = where
    return out


async def _size_of(backend: Backend, name: str) -> int | None:
    path = backend.path(name)
    backend.fs.invalidate_cache(path)  # a listing cache would hide what is stored now
    try:
        info = await backend.call(
            lambda: backend.fs_call("info", path),
            op="read",
            url=backend.object_url(name),
        )
    except errors.ObjectNotFoundError:
        return None
    return int(info.get("size") or 0)


async def _verify_file(
    backend: Backend,
    name: str,
    size: int,
    items: Mapping[int, Any],
    labels: dict[tuple[str, int], str],
    chunk_size: int,
    on_bytes: Callable[[int], None],
) -> tuple[FileReport, int]:
    import crc32c

    actual = await _size_of(backend, name)
    if actual is None:
        return FileReport(name, "missing", size), 0
    if actual != size:
        return FileReport(name, "size mismatch", size, actual), 0
    spans: list[tuple[int, int, int]] = []  # (start, end, crc), sorted, not overlapping
    for off, entry in sorted(items.items()):
        spans.append((off, off + entry.length, entry.crc))
    running = {off: 0 for off, _, _ in spans}
    pos = read = first = 0
    while pos < size:  # stream the file once, in ranged reads
        end = min(size, pos + chunk_size)
        data = await backend.cat(name, op="read", start=pos, end=end)
        if len(data) != end - pos:
            return FileReport(name, "size mismatch", size, pos + len(data)), read + len(data)
        view = memoryview(data)
        while first < len(spans) and spans[first][1] <= pos:
            first += 1  # items wholly before this chunk are done
        j = first
        while j < len(spans) and spans[j][0] < end:
            off, stop, _ = spans[j]
            lo, hi = max(off, pos), min(stop, end)
            if lo < hi:
                running[off] = crc32c.crc32c(view[lo - pos : hi - pos], value=running[off])
            j += 1
        read += len(data)
        on_bytes(len(data))
        pos = end
    bad = [
        f"item {labels.get((name, off), '?')} at byte {off}: crc32c {running[off]:08x}, "
        f"expected {crc:08x}"
        for off, _, crc in spans
        if running[off] != crc
    ]
    return FileReport(name, "checksum mismatch" if bad else "ok", size, actual, bad), read


def verify(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    max_concurrency: int = 4,
    chunk_size: int = 16 << 20,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read every byte of a checkpoint back and check sizes and CRC32C against its manifest.

    Each shard file is streamed once in ranged reads of ``chunk_size`` bytes, up to
    ``max_concurrency`` files at a time. A checkpoint written by torch's own writers has no
    manifest: nothing to verify, but the files named in ``.metadata`` must exist and be large
    enough for the items they hold.

    Args:
        url: the checkpoint.
        storage_options: passed to fsspec unchanged; never logged.
        max_concurrency: files read at the same time.
        chunk_size: bytes per ranged read.
        progress: called as ``progress(bytes_done, bytes_total)`` while reading.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        IncompleteCheckpointError: objects but no ``.metadata``.
    """
    if max_concurrency < 1 or chunk_size < 1:
        raise errors.ConfigError("max_concurrency and chunk_size must be >= 1")
    backend = _open(url, storage_options)
    loaded = _load(backend)
    md = loaded.metadata
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    where = redact_url(backend.url)
    manifest = loaded.manifest
    if manifest is None:
        files = backend.run(lambda: _check_sizes(backend, needed))
        if loaded.ours:
            assert loaded.manifest_problem is not None
            name = _layout.manifest_name(loaded.save_id)  # type: ignore[arg-type]
            files.insert(0, FileReport(name, "missing", 0))
            note = f"{loaded.manifest_problem}: checksums cannot be verified"
        else:
            note = (
                "no manifest: nothing to verify (not written by dcp_volumes); checked that "
                "the files named in .metadata exist and are large enough"
            )
        return VerifyReport(where, loaded.save_id, False, note, files)

    labels = _item_names(md)
    total = sum(e.size for e in manifest.files.values())
    done = 0
    lock = threading.Lock()

    def on_bytes(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            current = done
        if progress is not None:
            progress(current, total)

    async def _all() -> list[tuple[FileReport, int]]:
        gate = asyncio.Semaphore(max_concurrency)

        async def one(name: str) -> tuple[FileReport, int]:
            entry = manifest.files[name]
            async with gate:
                return await _verify_file(
                    backend, name, entry.size, entry.items, labels, chunk_size, on_bytes
                )

        return list(await asyncio.gather(*(one(n) for n in sorted(manifest.files))))

    results = backend.run(_all)
    files = [r for r, _ in results]
    for name in sorted(set(needed) - set(manifest.files)):
        files.append(FileReport(name, "not in manifest", needed[name]))
    note = f"checked size and CRC32C of {sum(len(e.items) for e in manifest.files.values())} items"
    return VerifyReport(where, loaded.save_id, True, note, files, sum(n for _, n in results))


async def _check_sizes(backend: Backend, needed: dict[str, int]) -> list[FileReport]:
    async def one(name: str, size: int) -> FileReport:
        actual = await _size_of(backend, name)
        if actual is None:
            return FileReport(name, "missing", size)
        return FileReport(name, "ok" if actual >= size else "size mismatch", size, actual)

    return list(await asyncio.gather(*(one(n, s) for n, s in sorted(needed.items()))))


# --------------------------------------------------------------------------------------------
# Describe


@dataclass(frozen=True)
class EntryInfo:
    """One state-dict entry of a checkpoint.

    Attributes:
        key: the fully qualified name, e.g. ``"model.layer.weight"``.
        kind: ``"tensor"`` or ``"bytes"`` (a pickled non-tensor object).
        dtype: e.g. ``"float32"`` (tensors only).
        shape: the global shape (tensors only).
        nbytes: ``numel * element size`` (tensors only).
        stored_bytes: bytes this entry takes in the shard files (all chunks, with torch's
            serialization overhead).
        chunks: how many pieces it was saved in.
    """

    key: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    nbytes: int | None
    stored_bytes: int
    chunks: int


@dataclass(frozen=True)
class CheckpointDetails:
    """What :func:`describe` reports about one checkpoint.

    Attributes:
        url: the checkpoint.
        save_id: the committed save's id (``None`` if not written by dcp_volumes).
        save_time: epoch seconds of the save (manifest, else ``.metadata``'s modification time,
            else the save id's timestamp).
        writer: e.g. ``"dcp_volumes 0.1.0"``, or ``None`` without a manifest.
        torch_version: torch version at save (from the manifest).
        world_size: ranks at save (from the manifest; ``None`` if unknown).
        ranks_in_files: distinct ranks that wrote shard files (from their names).
        files: number of shard files.
        objects: objects stored under the checkpoint.
        total_bytes: their total size.
        checksummed: a manifest with checksums exists.
        entries: the state-dict entries, sorted by key.
    """

    url: str
    save_id: str | None
    save_time: float | None
    writer: str | None
    torch_version: str | None
    world_size: int | None
    ranks_in_files: int
    files: int
    objects: int
    total_bytes: int
    checksummed: bool
    entries: list[EntryInfo]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointDetails:
    """Keys, shapes, dtypes and sizes of a checkpoint's state dict, and how it was saved.

    Reads ``.metadata`` (allow-listed unpickling), the manifest if any, and lists the
    checkpoint once.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        IncompleteCheckpointError: objects but no ``.metadata``.
    """
    backend = _open(url, storage_options)
    loaded = _load(backend)
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = loaded.metadata
    objects = backend.run(lambda: _scan(backend))
    stored: dict[str, list[int]] = {}
    for index, info in md.storage_data.items():
        stored.setdefault(index.fqn, []).append(info.length)
    entries: list[EntryInfo] = []
    for key, item in md.state_dict_metadata.items():
        lengths = stored.get(key, [])
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            numel = 1
            for s in item.size:
                numel *= int(s)
            elem = torch.empty((), dtype=dtype).element_size()
            entries.append(
                EntryInfo(
                    key,
                    "tensor",
                    str(dtype).removeprefix("torch."),
                    [int(s) for s in item.size],
                    numel * elem,
                    sum(lengths),
                    len(item.chunks),
                )
            )
        else:
            entries.append(EntryInfo(key, "bytes", None, None, None, sum(lengths), len(lengths)))
    entries.sort(key=lambda e: e.key)
    files = {info.relative_path for info in md.storage_data.values()}
    ranks = {int(m.group(1)) for f in files if (m := _RANK_RE.match(f))}
    manifest = loaded.manifest
    meta_obj = next((o for o in objects if o.name == _layout.METADATA), None)
    save_time = manifest.created if manifest is not None and manifest.created else None
    if save_time is None:
        save_time = meta_obj.mtime if meta_obj is not None and meta_obj.mtime else None
    if save_time is None:
        save_time = _save_id_time(loaded.save_id)
    return CheckpointDetails(
        url=redact_url(backend.url),
        save_id=loaded.save_id,
        save_time=save_time,
        writer=manifest.writer if manifest is not None else None,
        torch_version=loaded.torch_version,
        world_size=manifest.world_size if manifest is not None and manifest.world_size else None,
        ranks_in_files=len(ranks),
        files=len(files),
        objects=len(objects),
        total_bytes=sum(o.size for o in objects),
        checksummed=manifest is not None,
        entries=entries,
    )


# --------------------------------------------------------------------------------------------
# Garbage collection


@dataclass
class GcReport:
    """What :func:`gc` removed (or would remove, with ``dry_run``).

    Attributes:
        root: the run root.
        dry_run: nothing was deleted.
        older_than_s: the age threshold used.
        incomplete: URLs of stale incomplete checkpoints (no ``.metadata``).
        leftovers: URLs of objects inside complete checkpoints that belong to no committed save
            (a killed or losing save's shards and manifests, stale commit temp files).
        uploads: stale multipart uploads: ``{"key", "upload_id", "initiated"}`` (S3 only).
        bytes: bytes the removed objects held (uploaded parts not counted).
        skipped: what was left alone, and why.
    """

    root: str
    dry_run: bool
    older_than_s: float
    incomplete: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to collect."""
        return not (self.incomplete or self.leftovers or self.uploads)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _needs_metadata(objects: list[_Object]) -> bool:
    """Whether a complete checkpoint can hold leftovers at all (else skip reading .metadata)."""
    ids = {_layout.save_id_of(o.name) for o in objects} - {None}
    plain = any(_TORCH_SHARD_RE.match(o.name) for o in objects)
    tmp = any(_TMP_RE.match(o.name) for o in objects)
    return len(ids) > 1 or (bool(ids) and plain) or tmp


def _age(o: _Object, now: float) -> float | None:
    t = o.mtime if o.mtime is not None else _save_id_time(_layout.save_id_of(o.name))
    return None if t is None else max(0.0, now - t)


async def _stale_uploads(backend: Backend, older_than_s: float, now: float) -> list[dict[str, Any]]:
    bucket, _, key = backend.root.partition("/")
    prefix = key.rstrip("/") + "/"
    s3 = await backend.fs.set_session()
    out: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = await backend.call(
            functools.partial(s3.list_multipart_uploads, **kwargs), op="list", url=backend.url
        )
        for up in page.get("Uploads", []) or []:
            initiated = _to_epoch(up.get("Initiated"))
            if initiated is None or max(0.0, now - initiated) >= older_than_s:
                out.append(
                    {
                        "key": f"{bucket}/{up['Key']}",
                        "upload_id": up["UploadId"],
                        "initiated": initiated,
                    }
                )
        if not page.get("IsTruncated"):
            return out
        kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
        kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")


async def _abort_upload(backend: Backend, upload: dict[str, Any]) -> None:
    bucket, _, key = upload["key"].partition("/")
    s3 = await backend.fs.set_session()
    try:
        await backend.call(
            lambda: s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["upload_id"]),
            op="delete",
            url=f"{backend.scheme}://{upload['key']}",
        )
    except errors.ObjectNotFoundError:
        pass  # completed or aborted meanwhile


def gc(
    root: str | os.PathLike[str],
    *,
    older_than_s: float = 3600.0,
    storage_options: dict[str, Any] | None = None,
    step_pattern: str | re.Pattern[str] | None = None,
    dry_run: bool = True,
    progress: Progress | None = None,
) -> GcReport:
    """Collect what failed or superseded saves left under ``root``.

    Removes, when older than ``older_than_s`` (newest object's modification time):

    - incomplete checkpoints (no ``.metadata``) made only of DCP files -- a directory holding
      anything else is reported in ``skipped`` and left alone;
    - objects inside a complete checkpoint that belong to no committed save: shards and
      manifests whose save id differs from ``.metadata``'s ``storage_meta.save_id`` and that it
      does not name (a killed or losing save), and stale ``.metadata.*.tmp`` files;
    - S3 multipart uploads under the root initiated before the threshold (they cost storage
      and are invisible to listings).

    The threshold protects saves in progress: keep it well above the longest save.

    Args:
        root: the run root.
        older_than_s: minimum age, in seconds.
        storage_options: passed to fsspec unchanged; never logged.
        step_pattern: as for :func:`list_checkpoints`.
        dry_run: report only (the default); pass ``False`` to delete.
        progress: called as ``progress(done, total)`` while deleting objects and uploads.
    """
    if older_than_s < 0:
        raise errors.ConfigError(f"older_than_s must be >= 0, got {older_than_s}")
    pattern = _compile(step_pattern)
    backend = _open(root, storage_options)
    groups = _group(backend.run(lambda: _scan(backend)))
    now = time.time()
    report = GcReport(redact_url(backend.url), dry_run, float(older_than_s))
    whole: list[tuple[str, list[_Object]]] = []
    loose: list[str] = []  # relative to the root
    for info in _catalog(backend, groups, pattern):
        objs = groups[info.name]
        if not info.complete:
            ages = [_age(o, now) for o in objs]
            if any(a is None for a in ages):
                report.skipped.append(f"{info.url}: incomplete, age unknown")
            elif min(a for a in ages if a is not None) < older_than_s:
                report.skipped.append(
                    f"{info.url}: incomplete, written to recently (a save may be running)"
                )
            elif not all(_is_artifact(o.name) for o in objs):
                report.skipped.append(
                    f"{info.url}: incomplete, but holds files that are not checkpoint files"
                )
            else:
                whole.append((info.name, objs))
                report.incomplete.append(info.url)
                report.bytes += info.bytes
            continue
        if not _needs_metadata(objs):
            continue
        try:
            stray = _leftovers(backend, info.name, objs)
        except errors.DCPVolumesError as exc:
            report.skipped.append(f"{info.url}: .metadata unreadable ({type(exc).__name__})")
            continue
        for o in stray:
            age = _age(o, now)
            if age is not None and age >= older_than_s:
                loose.append(f"{info.name}/{o.name}")
                report.leftovers.append(f"{info.url}/{o.name}")
                report.bytes += o.size
    if backend.kind == "s3":
        report.uploads = backend.run(lambda: _stale_uploads(backend, older_than_s, now))
    if dry_run:
        return report

    total = sum(len(objs) for _, objs in whole) + len(loose) + len(report.uploads)
    done = 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    for name, objs in whole:
        backend.run(functools.partial(_delete_checkpoint, backend, name, objs))
        step(len(objs))
    if loose:
        backend.run(lambda: backend.remove(loose))
        step(len(loose))
    for up in report.uploads:
        backend.run(functools.partial(_abort_upload, backend, up))
        step(1)
    logger.info(
        "gc of %s: %d incomplete checkpoints, %d leftover objects, %d uploads, %d bytes",
        report.root,
        len(report.incomplete),
        len(report.leftovers),
        len(report.uploads),
        report.bytes,
    )
    return report


def _leftovers(backend: Backend, name: str, objects: list[_Object]) -> list[_Object]:
    from dcp_volumes._manifest import load_metadata, metadata_save_id

    rel = f"{name}/{_layout.METADATA}"
    data = backend.run(lambda: backend.cat(rel, op="read"))
    md = load_metadata(data, where=backend.object_url(rel))
    committed = metadata_save_id(md)
    referenced = {info.relative_path for info in md.storage_data.values()}
    if _layout.is_save_id(committed):
        referenced.add(_layout.manifest_name(committed))  # type: ignore[arg-type]
    out = []
    for o in objects:
        if o.name == _layout.METADATA or o.name in referenced:
            continue
        sid = _layout.save_id_of(o.name)
        if (sid is not None and sid != committed) or _TMP_RE.match(o.name):
            out.append(o)
    return out
