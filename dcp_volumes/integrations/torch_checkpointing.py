"""A torch_checkpointing ``Storage`` over dcp_volumes' backends, with a correct commit.

torch_checkpointing commits a save by renaming ``tmp_<name>`` onto ``<name>`` (rank 0, after
the barrier) and takes ``exists(<name>)`` as complete; on an object store a directory rename
is a copy, visible before it ends. Here every write goes to a fresh object, each rank records
its files (:func:`record_rank_files`), and the rename writes one commit object by conditional
create; only committed files are read. Use :func:`manager_config`; see docs/integrations/.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import crc32c
import torch.distributed as dist
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_writer import CallbackArgs
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from dcp_volumes import errors
from dcp_volumes.backends import Backend, CallStats, open_backend, redact_url
from dcp_volumes.backends.sink import Part
from dcp_volumes.config import RetryOptions, TransferOptions
from dcp_volumes.saving import PartStream, SpooledPart, Uploader

__all__ = ["COMMIT_NAME", "VolumeStorage", "VolumeStorageConfig", "manager_config",
           "record_rank_files"]

logger = logging.getLogger(__name__)

COMMIT_NAME = ".dcpv-commit.json"  #: exists in a checkpoint directory iff it is complete
RECORDS_DIR = ".dcpv-ranks"  #: the ranks' records, inside the temporary directory
_FORMAT = "dcp_volumes.torch_checkpointing/1"
_RESERVED = frozenset({COMMIT_NAME, RECORDS_DIR})
_MAX_JSON_BYTES, _MAX_FILES = 64 << 20, 1_000_000  # bounds on untrusted records


def _rel(path: str | os.PathLike[str]) -> str:
    """A torch_checkpointing path as a key relative to the root ("/a/./b" -> "a/b")."""
    parts = [p for p in Path(os.fspath(path)).as_posix().split("/") if p not in ("", ".")]
    if ".." in parts:
        raise errors.ConfigError(f"path {os.fspath(path)!r}: name paths without '..'")
    return "/".join(parts)


def _under(rel: str, parent: str) -> bool:
    return not parent or rel.startswith(parent + "/")


def _strip(rel: str, parent: str) -> str:
    return rel[len(parent) + 1:] if parent else rel


@dataclass(kw_only=True)
class VolumeStorageConfig(StorageConfig):
    """Where torch_checkpointing's checkpoints go: a run root URL on any dcp_volumes store.

    Attributes:
        url: root of the run, e.g. ``s3://bucket/run-42``; checkpoint ids are paths under it.
        storage_options: fsspec options (endpoint, credentials); passed to fsspec, never logged.
        part_size: bytes per multipart part (S3 needs >= 5 MiB; GCS a multiple of 256 KiB).
        parts_in_flight: part uploads in flight per file written (memory: × ``part_size``).
        retry: retries of transient store errors.
        rank, world_size: this process's place; by default from ``torch.distributed``.
        job: an id shared by the job's ranks (default: rank 0 broadcasts a random one, so
            build the config on every rank); the commit refuses another job's records.
    """

    url: str
    storage_options: dict[str, Any] | None = None
    part_size: int = 16 << 20
    parts_in_flight: int = 4
    retry: RetryOptions = field(default_factory=RetryOptions)
    rank: int | None = None
    world_size: int | None = None
    job: str | None = None

    def __post_init__(self) -> None:
        TransferOptions(part_size=self.part_size)  # validates part_size (S3, GCS rules)
        if type(self.parts_in_flight) is not int or self.parts_in_flight < 1:
            raise errors.ConfigError(f"VolumeStorageConfig.parts_in_flight must be an int >= 1, "
                                     f"got {self.parts_in_flight!r}")
        live = dist.is_available() and dist.is_initialized()
        here = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
        if self.rank is None and self.world_size is None:
            self.rank, self.world_size = here
        token = [self.job or uuid.uuid4().hex]
        if self.job is None and here[1] > 1:
            dist.broadcast_object_list(token, src=0)
        self.job = str(token[0])
        if self.rank is None or self.world_size is None or not 0 <= self.rank < self.world_size:
            raise errors.ConfigError(f"VolumeStorageConfig needs 0 <= rank < world_size, got "
                                     f"{self.rank}, {self.world_size}: pass both, or neither")

    def create_storage(self) -> VolumeStorage:
        if dist.is_available() and dist.is_initialized() and (
                (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size)):
            raise errors.ConfigError(f"VolumeStorageConfig is for rank {self.rank} of "
                                     f"{self.world_size}: build it after init_process_group")
        return VolumeStorage(self)


def record_rank_files(args: CallbackArgs) -> None:
    """``pre_finalize_callback``: record the files this rank wrote into ``args.path`` (chain
    it last from your own callback; without it the commit refuses: nothing becomes visible)."""
    if not isinstance(args.storage, VolumeStorage):
        raise errors.ConfigError("record_rank_files needs storage_config=VolumeStorageConfig()")
    args.storage.write_rank_record(args.path)


def manager_config(url: str, *, storage_options: dict[str, Any] | None = None,
                   storage: dict[str, Any] | None = None, **fields: Any
                   ) -> CheckpointManager.Config:
    """A ``CheckpointManager.Config`` saving under ``url`` through dcp_volumes (call it after
    ``init_process_group``). ``storage``: more :class:`VolumeStorageConfig` fields;
    ``fields``: ``CheckpointManager.Config`` fields (``items=``, ``save=``, ...)."""
    config = VolumeStorageConfig(url=url, storage_options=storage_options, **(storage or {}))
    return CheckpointManager.Config(storage_config=config,
                                    pre_finalize_callback=record_rank_files, **fields)


class VolumeStorage(Storage):
    """torch_checkpointing ``Storage`` over one dcp_volumes :class:`Backend` (see module)."""

    def __init__(self, config: VolumeStorageConfig) -> None:
        self._config, self._lock = config, threading.Lock()
        self._backend_obj: Backend | None = None
        self._written: dict[str, tuple[str, int]] = {}  # not yet recorded: name -> (key, size)
        self._manifests: dict[str, dict[str, tuple[str, int]]] = {}  # committed ones seen
        self._sizes: dict[str, int] = {}  # object key -> size checked against the store

    @property
    def backend(self) -> Backend:
        if self._backend_obj is None:
            self._backend_obj = open_backend(self._config.url, self._config.storage_options,
                                             self._config.retry)
        return self._backend_obj

    def _run(self, coro_fn: Any) -> Any:  # one event-loop bridge: the backend's
        return self.backend.run(coro_fn)

    def _get_json(self, key: str) -> Any | None:
        """A small JSON object from the store, ``None`` when absent (bounded: untrusted)."""
        size = self._run(lambda: self.backend.size(key))
        where = redact_url(self.backend.object_url(key))
        if size is not None and size > _MAX_JSON_BYTES:
            raise errors.IntegrityError(f"{where} is {size} bytes: too big for a commit record")
        try:
            return None if size is None else json.loads(self._run(lambda: self.backend.cat(key)))
        except ValueError as exc:
            raise errors.IntegrityError(f"{where} is not JSON: remove the checkpoint") from exc

    def _scan(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (one listing): key relative to root -> size."""
        sub = open_backend(self.backend.object_url(prefix), self._config.storage_options,
                           self._config.retry)
        return {f"{prefix}/{o.name}": o.size for o in sub.run(sub.scan)}

    def _manifest(self, directory: str) -> dict[str, tuple[str, int]] | None:
        """The files of the committed checkpoint at ``directory``, ``None`` if not one."""
        if directory not in self._manifests:
            raw = self._get_json(posixpath.join(directory, COMMIT_NAME))
            if raw is None:
                return None
            self._manifests[directory] = _parse_manifest(raw, where=self.backend.object_url(
                directory))
        return self._manifests[directory]

    def _in_committed(self, rel: str, *, include_self: bool = True
                      ) -> tuple[str, dict[str, tuple[str, int]]] | None:
        """(directory, files) of the committed checkpoint ``rel`` is or is in; nearest first."""
        parts = rel.split("/")
        candidates = ["/".join(parts[:i]) for i in range(len(parts) - (not include_self), 0, -1)]
        for directory in [d for d in candidates if d in self._manifests][:1] or candidates:
            files = self._manifest(directory)
            if files is not None:
                return directory, files
        return None

    def _resolve(self, path: str | os.PathLike[str]) -> tuple[str, int]:
        """The object behind a committed file, its size checked against the store."""
        rel = _rel(path)
        inside = self._in_committed(rel, include_self=False)
        found = None if inside is None else inside[1].get(_strip(rel, inside[0]))
        where = redact_url(self.backend.object_url(rel))
        if found is None:
            raise errors.ObjectNotFoundError(f"{where} is not a file of a committed checkpoint "
                                             "(an interrupted or running save is never read)")
        key, size = found
        actual = self._sizes.get(key) or self._run(lambda: self.backend.size(key))
        if actual != size:
            raise errors.IntegrityError(f"{where}: the commit record says {size} bytes, the "
                                        f"store holds {actual}: it was damaged")
        self._sizes[key] = size
        return key, size

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        key, size = self._resolve(path)
        if read_args is not None and read_args.known_size_bytes not in (None, size):
            raise errors.IntegrityError(f"{_rel(path)!r}: expected {read_args.known_size_bytes} "
                                        f"bytes, the commit record says {size}")
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(self._cat(key, size))  # type: ignore[return-value]
        return _RangeReader(self, key, size)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        key, size = self._resolve(path)
        return self._cat(key, size)

    def _cat(self, key: str, size: int, start: int = 0, end: int | None = None) -> bytes:
        end = size if end is None else end
        if end <= start:
            return b""
        data: bytes = self._run(lambda: self.backend.cat(key, start=start, end=end))
        if len(data) != end - start:
            raise errors.IntegrityError(f"{redact_url(self.backend.object_url(key))}: "
                                        f"{len(data)} bytes of [{start}, {end}): truncated")
        return data

    def _names(self, rel: str) -> tuple[str | None, list[str]]:
        """(committed checkpoint ``rel`` is in, or None: own writes; names under ``rel``)."""
        inside = self._in_committed(rel)
        if inside is not None:
            directory, files = inside
            sub = _strip(rel, directory) if rel != directory else ""
            return directory, [_strip(f, sub) if f != sub else "" for f in files
                               if f == sub or _under(f, sub)]
        with self._lock:
            return None, [_strip(k, rel) if k != rel else "" for k in self._written
                          if k == rel or _under(k, rel)]

    def exists(self, path: Path) -> bool:
        """A committed checkpoint or a file of one; or a directory this process, or a rank
        that finished its part of a save, wrote into (the writer checks it before renaming)."""
        rel = _rel(path)
        directory, names = self._names(rel)
        if directory is not None or names:
            return rel == directory or bool(names)
        return bool(rel) and bool(self._scan(posixpath.join(rel, RECORDS_DIR)))

    def isdir(self, path: Path) -> bool:
        rel = _rel(path)
        directory, names = self._names(rel)
        return rel == directory or any(names)

    def ls(self, path: Path) -> list[str]:
        rel = _rel(path)
        _, names = self._names(rel)
        if not any(names):
            raise errors.ObjectNotFoundError(f"no committed checkpoint directory at "
                                             f"{redact_url(self.backend.object_url(rel))}")
        return sorted({n.split("/", 1)[0] for n in names if n})

    def getsize(self, path: Path) -> int:
        return self._resolve(path)[1]

    def remap_path(self, path: Path) -> str:
        return self.backend.object_url(_rel(path))

    def _new_key(self, path: str | os.PathLike[str]) -> tuple[str, str]:
        rel = _rel(path)
        if not rel or _RESERVED & set(rel.split("/")):
            raise errors.ConfigError(f"cannot write {rel!r}: {sorted(_RESERVED)} are reserved")
        return rel, f"{rel}.{uuid.uuid4().hex[:16]}"

    def stream_write(self, path: Path) -> io.IOBase:
        return _UploadStream(self, *self._new_key(path))

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        _rel(path)  # no directories in object stores: only validate the name

    def write_rank_record(self, directory: str | os.PathLike[str]) -> None:
        """Record (and forget: the commit keeps or removes them) this rank's files there."""
        rel, cfg = _rel(directory), self._config
        with self._lock:
            mine = {k: v for k, v in self._written.items() if _under(k, rel)}
            self._written = {k: v for k, v in self._written.items() if k not in mine}
        data = json.dumps({"format": _FORMAT, "rank": cfg.rank, "world_size": cfg.world_size,
                           "job": cfg.job, "files": {_strip(k, rel): list(v)
                                                     for k, v in mine.items()}}).encode()
        key = posixpath.join(rel, RECORDS_DIR, f"rank-{cfg.rank}-of-{cfg.world_size}.json")
        self._run(lambda: self.backend.put(key, data))

    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False,
               background_cleanup: bool = False) -> None:
        """A directory: the commit. A file: only one this process wrote since its record."""
        src, dst = _rel(src_path), _rel(dst_path)
        if is_directory:
            return self._commit(src, dst)
        with self._lock:
            entry = self._written.pop(src, None)
            if entry is None:
                raise errors.ObjectNotFoundError(f"cannot rename {src!r}: committed files "
                                                 "never change")
            self._written[dst] = entry

    def _commit(self, src: str, dst: str) -> None:
        """Commit the save staged under ``src`` as the checkpoint ``dst`` (rank 0)."""
        url = redact_url(self.backend.object_url(dst))
        if not src or not dst or src == dst:
            raise errors.ConfigError(f"cannot commit {src!r} as {dst!r}: write_to_temp_dir=True")
        if self._manifest(dst) is not None:
            raise errors.CheckpointExistsError(f"{url} is already a committed checkpoint: save "
                                               "under a new name, or rmdir() it first")
        files = self._gather_records(src)
        present = self._scan(src)
        short = sorted(n for n, (key, size) in files.items() if present.get(key) != size)
        if short:
            raise errors.IncompleteCheckpointError(f"{short[:3]} of {url} are missing or short "
                                                   "in the store: not committing")
        data = json.dumps({"format": _FORMAT, "source": src, "job": self._config.job,
                           "files": {n: list(v) for n, v in files.items()}}).encode()
        key = posixpath.join(dst, COMMIT_NAME)
        try:
            self._run(lambda: self.backend.commit(key, data, exclusive=True,
                                                  save_id=str(self._config.job)))
        except errors.CheckpointExistsError:  # ours, if a retry followed a lost answer
            if self._get_json(key) != json.loads(data):
                raise
        self._manifests[dst] = files
        keep = {k for k, _ in files.values()}
        stale = [k for k in present if k not in keep and not _under(k, f"{src}/{RECORDS_DIR}")]
        try:  # objects of earlier, interrupted attempts: referenced by nothing
            self._run(lambda: self.backend.remove(stale))
        except errors.DCPVolumesError as exc:
            logger.warning("committed %s; %d stale objects left: %s", url, len(stale), exc)
        logger.info("committed %s: %d files of %d ranks", url, len(files), self._config.world_size)

    def _gather_records(self, src: str) -> dict[str, tuple[str, int]]:
        """The files of ranks ``0..world_size-1``, from records of this job only."""
        world, files = self._config.world_size or 1, {}
        for rank in range(world):
            key = posixpath.join(src, RECORDS_DIR, f"rank-{rank}-of-{world}.json")
            where = redact_url(self.backend.object_url(key))
            raw = self._get_json(key)
            if not isinstance(raw, dict) or raw.get("job") != self._config.job:
                raise errors.IncompleteCheckpointError(
                    f"no record {where} of this job (set pre_finalize_callback=record_rank_files"
                    "; two jobs saving to one path are refused): not committing")
            for name, entry in _parse_files(raw, src, where=where).items():
                if name in files:
                    raise errors.ConfigError(f"two ranks wrote {name!r}: give every rank its "
                                             "own file names in the layout")
                files[name] = entry
        return files

    def delete(self, path: Path) -> None:
        """Only a file this process wrote since its last record (so no commit names it)."""
        with self._lock:
            entry = self._written.pop(_rel(path), None)
        if entry is None:
            raise errors.ObjectNotFoundError(f"cannot delete {_rel(path)!r}: committed files "
                                             "never change (rmdir() the checkpoint)")
        self._run(lambda: self.backend.remove([entry[0]]))

    def rmdir(self, path: Path) -> None:
        """Remove a checkpoint, or everything under a directory: commit objects first."""
        rel = _rel(path)
        if not rel:
            raise errors.ConfigError("refusing to remove the whole storage root")
        raw = self._get_json(posixpath.join(rel, COMMIT_NAME))
        sources = [rel]
        if raw is not None:
            _parse_manifest(raw, where=self.backend.object_url(rel))
            sources.append(str(raw["source"]))
        objects = [k for source in sources for k in self._scan(source)]
        commits = [k for k in objects if posixpath.basename(k) == COMMIT_NAME]
        self._run(lambda: self.backend.remove(commits))
        self._run(lambda: self.backend.remove([k for k in objects if k not in commits]))
        self._manifests.clear()


def _safe(name: object) -> bool:
    """A clean relative key: no leading '/', no '', '.' or '..' component."""
    return isinstance(name, str) and all(p not in ("", ".", "..") for p in name.split("/"))


def _parse_files(raw: Any, source: str, *, where: str) -> dict[str, tuple[str, int]]:
    """A record's or commit record's files, validated (untrusted): clean names, objects
    inside ``source``, sizes non-negative ints."""
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict) or raw.get("format") != _FORMAT or len(files) > _MAX_FILES:
        raise errors.IntegrityError(f"{redact_url(where)} is not a dcp_volumes "
                                    "torch_checkpointing record: remove the checkpoint")
    for name, entry in files.items():
        if not (_safe(name) and isinstance(entry, list) and len(entry) == 2 and _safe(entry[0])
                and _under(entry[0], source) and type(entry[1]) is int and entry[1] >= 0):
            raise errors.UnsafeCheckpointError(f"{redact_url(where)} names a file outside its "
                                               f"checkpoint ({name!r}): refusing to read it")
    return {name: (entry[0], entry[1]) for name, entry in files.items()}


def _parse_manifest(raw: Any, *, where: str) -> dict[str, tuple[str, int]]:
    source = raw.get("source") if isinstance(raw, dict) else None
    if not _safe(source):
        raise errors.UnsafeCheckpointError(f"{redact_url(where)} names no valid source "
                                           "directory: refusing to read it")
    return _parse_files(raw, str(source), where=where)


class _RangeReader(io.RawIOBase):
    """A seekable read stream of one committed object: each ``readinto`` is one ranged GET."""

    def __init__(self, storage: VolumeStorage, key: str, size: int) -> None:
        self._storage, self._key, self._size, self._pos = storage, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._size, self._pos + len(view))
        data = self._storage._cat(self._key, self._size, self._pos, end)
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)


class _UploadStream(io.RawIOBase):
    """A write stream into one new object through the package's :class:`Uploader` (the
    save's part uploads: adaptive concurrency, the backend's sink, multipart on S3, abort on
    failure), at most ``parts_in_flight`` parts held in memory; durable when ``close``
    returns, aborted on error."""

    def __init__(self, storage: VolumeStorage, rel: str, key: str) -> None:
        self._storage, self._rel, self._key = storage, rel, key
        cfg = storage._config
        self._part_size = cfg.part_size
        self._uploader = Uploader(storage.backend, part_size=cfg.part_size,
                                  max_concurrency=cfg.parts_in_flight, stats=CallStats())
        self._parts = PartStream()
        self._slots = threading.BoundedSemaphore(cfg.parts_in_flight)
        self._uploader.upload(key, self._parts)
        self._buf, self._offset, self._number, self._finished = bytearray(), 0, 0, False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        while len(self._buf) > self._part_size:  # the last part is sent by close
            chunk = self._buf[:self._part_size]
            del self._buf[:self._part_size]
            self._send(chunk, final=False)
        return len(view)

    def _send(self, chunk: bytearray, *, final: bool) -> None:
        self._number += 1
        part = Part(self._number, self._offset, len(chunk), final, crc32c.crc32c(chunk))
        self._offset += len(chunk)
        self._slots.acquire()  # released when the part is uploaded, or dropped on failure
        self._parts.put(SpooledPart(part, buffer=chunk, release=self._slots.release))

    def close(self) -> None:
        if not self._finished and not self.closed:
            self._finished = True
            try:
                self._send(self._buf, final=True)
                self._parts.end()
                self._uploader.wait()
            except BaseException:
                self._uploader.abort()
                raise
            with self._storage._lock:
                self._storage._written[self._rel] = (self._key, self._offset)
        super().close()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and not self._finished:
            self._finished = True
            self._uploader.abort()
        super().__exit__(exc_type, exc, tb)
