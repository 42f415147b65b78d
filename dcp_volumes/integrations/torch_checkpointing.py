"""A torch_checkpointing ``Storage`` over dcp_volumes' backends, with a correct commit.

torch_checkpointing commits a save by renaming ``tmp_<name>`` onto ``<name>`` (rank 0, after
the barrier) and takes ``exists(<name>)`` as complete; on an object store a directory rename
is a copy, visible before it ends. Here every write goes to a fresh object in ``<name>/``
(through the save path's Uploader), each rank records its files (:func:`record_rank_files`),
and the rename commits ``<name>`` as a dcp_volumes checkpoint (``dcp_volumes._commit``:
manifest, then ``.metadata`` by conditional create); only committed files are read, through
the load path's serve path with every block's CRC32C checked. Use :func:`manager_config`
and :func:`resume_path`; see docs/integrations/torch_checkpointing.md.
"""

from __future__ import annotations

import io
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_writer import DEFAULT_TEMP_DIR_PREFIX, CallbackArgs
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from dcp_volumes import catalog, errors
from dcp_volumes._layout import METADATA, check_relative_path
from dcp_volumes._manifest import FileEntry
from dcp_volumes.backends import Backend, open_backend, redact_url
from dcp_volumes.catalog import delete_checkpoint
from dcp_volumes.config import RetryOptions, TransferOptions
from dcp_volumes.integrations import _tc_checkpoint as stored
from dcp_volumes.loading.objects import ObjectReader, read_object
from dcp_volumes.saving.objects import write_object

__all__ = ["COMMIT_NAME", "VolumeStorage", "VolumeStorageConfig", "manager_config",
           "record_rank_files", "resume_path"]

COMMIT_NAME = METADATA  #: exists in a checkpoint directory iff it is committed
_JOB = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _rel(path: str | os.PathLike[str]) -> str:
    """A torch_checkpointing path as a key relative to the root ("/a/./b" -> "a/b"),
    checked by the package's one check of relative paths ("" is the root)."""
    rel = "/".join(p for p in Path(os.fspath(path)).as_posix().split("/") if p not in ("", "."))
    try:
        return rel and check_relative_path(rel)
    except errors.UnsafeCheckpointError:
        raise errors.ConfigError(f"path {os.fspath(path)!r}: name paths without '..' inside "
                                 "the storage root") from None


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
        part_size: bytes per multipart part (S3 needs >= 5 MiB; GCS a multiple of 256 KiB),
            also the block a read fetches and checks (one CRC32C per part).
        parts_in_flight: part uploads (and ranged GETs) in flight per file (memory: one
            more × ``part_size``, the part being filled).
        retry: retries of transient store errors.
        rank, world_size: this process's place; by default from ``torch.distributed``.
        job: an id shared by the job's ranks (default: rank 0 broadcasts a random one, so
            build the config on every rank); the commit takes only this job's records.
        temp_dir_prefix: the writer's ``temp_dir_prefix`` (torch_checkpointing's default;
            :func:`manager_config` copies the one of ``save=``): a write into
            ``<parent>/<prefix><name>/`` goes to the checkpoint ``<parent>/<name>/``.
    """

    url: str
    storage_options: dict[str, Any] | None = None
    part_size: int = 16 << 20
    parts_in_flight: int = 4
    retry: RetryOptions = field(default_factory=RetryOptions)
    rank: int | None = None
    world_size: int | None = None
    job: str | None = None
    temp_dir_prefix: str = DEFAULT_TEMP_DIR_PREFIX

    def __post_init__(self) -> None:
        TransferOptions(part_size=self.part_size)  # validates part_size (S3, GCS rules)
        if type(self.parts_in_flight) is not int or self.parts_in_flight < 1:
            raise errors.ConfigError(f"VolumeStorageConfig.parts_in_flight must be an int >= 1, "
                                     f"got {self.parts_in_flight!r}")
        if not self.temp_dir_prefix or "/" in self.temp_dir_prefix:
            raise errors.ConfigError("VolumeStorageConfig.temp_dir_prefix must be a non-empty "
                                     "name (the writer's temp_dir_prefix)")
        live = dist.is_available() and dist.is_initialized()
        here = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
        if self.rank is None and self.world_size is None:
            self.rank, self.world_size = here
        token = [self.job or uuid.uuid4().hex]
        if self.job is None and here[1] > 1:
            dist.broadcast_object_list(token, src=0)
        self.job = str(token[0])
        if not _JOB.fullmatch(self.job):
            raise errors.ConfigError("VolumeStorageConfig.job must be 1-64 letters, digits, "
                                     "'-' or '_'")
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
    """``pre_finalize_callback``: record the files this rank wrote into ``args.path``
    (:func:`manager_config` sets it, after yours; without it the commit refuses)."""
    if not isinstance(args.storage, VolumeStorage):
        raise errors.ConfigError("record_rank_files needs storage_config=VolumeStorageConfig()")
    args.storage.write_rank_record(args.path)


@dataclass(frozen=True)
class _ThenRecord:
    """A user's ``pre_finalize_callback``, then :func:`record_rank_files` (picklable when
    the user's callback is: the async saver sends it to its writer process)."""

    first: Callable[[CallbackArgs], None]

    def __call__(self, args: CallbackArgs) -> None:
        self.first(args)
        record_rank_files(args)


def manager_config(url: str, *, storage_options: dict[str, Any] | None = None,
                   storage: dict[str, Any] | None = None,
                   pre_finalize_callback: Callable[[CallbackArgs], None] | None = None,
                   **fields: Any) -> CheckpointManager.Config:
    """A ``CheckpointManager.Config`` saving under ``url`` through dcp_volumes (call it on
    every rank, after ``init_process_group``).

    Args:
        url: the run root; checkpoint ids are paths under it.
        storage_options: fsspec options, never logged.
        storage: more :class:`VolumeStorageConfig` fields.
        pre_finalize_callback: yours, if any: it runs first, then the rank's files are
            recorded (:func:`record_rank_files`).
        fields: ``CheckpointManager.Config`` fields (``items=``, ``save=``, ...).

    Raises:
        BucketNotFoundError: the bucket or container of ``url`` does not exist (one
            request: the async saver would find it only in its writer process, at the first
            save).
        StoragePermissionError: the store refused the credentials.
    """
    writer = getattr(fields.get("save"), "writer_config", None)
    prefix = {"temp_dir_prefix": writer.temp_dir_prefix} if writer is not None else {}
    config = VolumeStorageConfig(url=url, storage_options=storage_options,
                                 **{**prefix, **(storage or {})})
    backend = open_backend(url, storage_options, config.retry)
    backend.run(backend.check_bucket)
    callback = (record_rank_files if pre_finalize_callback is None
                else _ThenRecord(pre_finalize_callback))
    return CheckpointManager.Config(storage_config=config, pre_finalize_callback=callback,
                                    **fields)


def resume_path(url: str, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The id of the newest complete checkpoint directly under the run root ``url`` (highest
    step in its name, e.g. ``"step-1000"``), for ``manager.load``; ``None`` when there is
    nothing to resume. With ``torch.distributed`` initialized, call it on every rank (rank 0
    lists, the answer is broadcast)."""
    found = catalog.latest(url, storage_options=storage_options)
    return None if found is None else found.name


class VolumeStorage(Storage):
    """torch_checkpointing ``Storage`` over dcp_volumes' backends (see the module)."""

    def __init__(self, config: VolumeStorageConfig) -> None:
        self._config, self._lock = config, threading.Lock()
        self._backends: dict[str, Backend] = {}
        self._written: dict[str, tuple[str, FileEntry]] = {}  # path -> (object key, entry)
        self._views: dict[str, stored.View] = {}  # committed checkpoints seen, by directory

    @property
    def backend(self) -> Backend:
        return self._at("")

    def _at(self, directory: str) -> Backend:
        """The backend rooted at ``directory`` (relative to the root)."""
        if directory not in self._backends:
            url = self._config.url if not directory else self.backend.object_url(directory)
            self._backends[directory] = open_backend(url, self._config.storage_options,
                                                     self._config.retry)
        return self._backends[directory]

    def _final(self, directory: str) -> str:
        """The checkpoint a temporary directory ``<parent>/<prefix><name>`` is saved as."""
        parent, _, name = directory.rpartition("/")
        prefix = self._config.temp_dir_prefix
        if len(name) <= len(prefix) or not name.startswith(prefix):
            return directory
        return f"{parent}/{name[len(prefix):]}" if parent else name[len(prefix):]

    def _key(self, rel: str) -> str:
        """The fresh object a write of ``rel`` goes to: in its checkpoint's directory."""
        parts = rel.split("/")
        if any(p == METADATA or p.startswith(stored.RESERVED_PREFIX) for p in parts):
            raise errors.ConfigError(f"cannot write {rel!r}: {METADATA!r} and names starting "
                                     f"with {stored.RESERVED_PREFIX!r} are reserved")
        for i in range(len(parts) - 1, 0, -1):  # the nearest temporary directory
            head = "/".join(parts[:i])
            if self._final(head) != head:
                rel = "/".join([self._final(head), *parts[i:]])
                break
        return f"{rel}.{uuid.uuid4().hex[:16]}"

    def _committed(self, rel: str, *, include_self: bool = True
                   ) -> tuple[str, stored.View] | None:
        """(directory, files) of the committed checkpoint ``rel`` is or is in; nearest first."""
        parts = rel.split("/") if rel else []
        candidates = ["/".join(parts[:i]) for i in range(len(parts) - (not include_self), 0, -1)]
        for directory in [d for d in candidates if d in self._views][:1] or candidates:
            if directory not in self._views:
                view = stored.read_view(self._at(directory))
                if view is None:
                    continue
                self._views[directory] = view
            return directory, self._views[directory]
        return None

    def _resolve(self, path: str | os.PathLike[str]) -> tuple[str, stored.Stored]:
        rel = _rel(path)
        inside = self._committed(rel, include_self=False)
        found = None if inside is None else inside[1].get(_strip(rel, inside[0]))
        if inside is None or found is None:
            raise errors.ObjectNotFoundError(
                f"{redact_url(self.backend.object_url(rel))} is not a file of a committed "
                "checkpoint (an interrupted or running save is never read)")
        return inside[0], found

    def _reader(self, path: str | os.PathLike[str]) -> ObjectReader:
        directory, found = self._resolve(path)
        return read_object(self._at(directory), found.key, found.entry,
                           max_concurrency=self._config.parts_in_flight,
                           chunk_size=self._config.part_size)

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        reader = self._reader(path)
        size = reader.seek(0, io.SEEK_END)
        reader.seek(0)
        if read_args is not None and read_args.known_size_bytes not in (None, size):
            raise errors.IntegrityError(f"{_rel(path)!r}: expected {read_args.known_size_bytes} "
                                        f"bytes, the checkpoint's manifest says {size}")
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(reader.readall())  # type: ignore[return-value]
        return reader

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._reader(path).readall()

    def _names(self, rel: str) -> tuple[str | None, list[str]]:
        """(committed checkpoint ``rel`` is in, or None: own writes; names under ``rel``)."""
        inside = self._committed(rel)
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
        final = self._final(rel)
        return final != rel and any(o.name.startswith(stored.RECORD_PREFIX)
                                    for o in self._at(final).run(self._at(final).scan))

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
        return self._resolve(path)[1].size

    def remap_path(self, path: Path) -> str:
        return self.backend.object_url(_rel(path))

    def stream_write(self, path: Path) -> io.IOBase:
        rel = _rel(path)
        if not rel:
            raise errors.ConfigError("cannot write the storage root: name a file")
        key = self._key(rel)

        def done(entry: FileEntry) -> None:
            with self._lock:
                self._written[rel] = (key, entry)

        return write_object(self.backend, key, part_size=self._config.part_size,
                            max_concurrency=self._config.parts_in_flight, done=done)

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        _rel(path)  # no directories in object stores: only validate the name

    def write_rank_record(self, directory: str | os.PathLike[str]) -> None:
        """Record (and forget: the commit keeps or removes them) this rank's files there."""
        rel, cfg = _rel(directory), self._config
        final = self._final(rel)
        with self._lock:
            mine = {k: v for k, v in self._written.items() if _under(k, rel)}
            self._written = {k: v for k, v in self._written.items() if k not in mine}
        if any(not _under(key, final) for key, _ in mine.values()):
            raise errors.ConfigError(f"files recorded for {rel!r} were written outside "
                                     f"{final!r}: set temp_dir_prefix to the writer's")
        files = {_strip(k, rel): stored.Stored(_strip(key, final), entry)
                 for k, (key, entry) in mine.items()}
        backend = self._at(final)
        backend.run(lambda: stored.write_record(backend, files, rank=cfg.rank or 0,
                                                world_size=cfg.world_size or 1,
                                                job=str(cfg.job)))

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
        """Commit the save staged for ``src`` as the checkpoint ``dst`` (rank 0)."""
        if not src or not dst or src == dst or self._final(src) != dst:
            raise errors.ConfigError(
                f"cannot commit {src!r} as {dst!r}: keep write_to_temp_dir=True and give "
                f"VolumeStorageConfig the writer's temp_dir_prefix "
                f"({self._config.temp_dir_prefix!r} now)")
        backend, world = self._at(dst), self._config.world_size or 1
        job = str(self._config.job)
        if self._committed(dst) is not None:
            keep = {s.key for s in self._views.get(dst, {}).values()}
            backend.run(lambda: stored.discard(backend, world_size=world, job=job, keep=keep))
            raise errors.CheckpointExistsError(
                f"Checkpoint already exists: {redact_url(backend.url)} is committed; this "
                "save's files were removed. Save under a new name, or rmdir() it first")
        self._views[dst] = backend.run(lambda: stored.commit_recorded(backend, world_size=world,
                                                                       job=job))

    def delete(self, path: Path) -> None:
        """Only a file this process wrote since its last record (so no commit names it)."""
        with self._lock:
            entry = self._written.pop(_rel(path), None)
        if entry is None:
            raise errors.ObjectNotFoundError(f"cannot delete {_rel(path)!r}: committed files "
                                             "never change (rmdir() the checkpoint)")
        self.backend.run(lambda: self.backend.remove([entry[0]]))

    def rmdir(self, path: Path) -> None:
        """Remove a checkpoint, or everything under a directory: ``.metadata`` first."""
        rel = _rel(path)
        if not rel:
            raise errors.ConfigError("refusing to remove the whole storage root")
        backend = self._at(rel)
        objects = backend.run(backend.scan)
        backend.run(lambda: delete_checkpoint(backend, "", objects))
        self._views.clear()
