"""``SafetensorsReader``: Hugging Face safetensors in any store as a DCP source.

``dcp.load(state, storage_reader=SafetensorsReader("s3://b/model/", prefix="model."))`` fills
plain, FSDP/DTensor-sharded or replicated state from ``model.safetensors`` (or the numbered
files an index names) with ranged reads: each rank fetches only the element ranges its shards
need, and a range several ranks need is fetched once and sent over the process group.

It is a :class:`~dcp_volumes.VolumeReader` whose ``.metadata`` and manifest are built from the
files' headers instead of read from storage: one stored item per tensor (the tensor's raw
bytes, C order), so the reader's whole read path — narrowing to the elements a rank needs,
coalescing, concurrency, copies straight into the targets, cooperative loads — applies as for
a checkpoint. The entries it builds carry no checksum (safetensors has none): lengths are
checked, every tensor read is conditional on the version of its file pinned when the header
was read (a file replaced meanwhile: :class:`~dcp_volumes.errors.CheckpointChangedError`,
never the new file's bytes at the old header's offsets), and ``LoadStats.verified`` is
False. The "no checksum" marking exists only in entries this module builds
(``ItemEntry.raw``), never in a manifest read from storage. It plugs into the reader through
its public seam, :meth:`~dcp_volumes.VolumeReader.open_checkpoint`.

Everything read from storage is untrusted (``DESIGN.md``, "Trust boundary"): the index is
size-capped and names only plain ``*.safetensors`` files in the same directory; each header
is checked against its object's real size (one size lookup per file) before its JSON is
fetched, and every entry's dtype, shape and offsets before any tensor byte is
(:mod:`dcp_volumes.export._format`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_volumes import _layout, _typed, errors
from dcp_volumes._manifest import FileEntry, ItemEntry, Manifest
from dcp_volumes.backends import Backend, redact_url
from dcp_volumes.backends.versions import ObjectVersion
from dcp_volumes.config import RetryOptions, TransferOptions
from dcp_volumes.export import _format
from dcp_volumes.reader import Opened, VolumeReader

__all__ = ["INDEX_NAME", "MAX_INDEX_BYTES", "SafetensorsReader"]

#: the Hugging Face index of a sharded model
INDEX_NAME = "model.safetensors.index.json"
#: the largest index accepted (a 1000-file model's index is about 100 KB)
MAX_INDEX_BYTES = 16 * 2**20
_SUFFIX = ".safetensors"
#: ranges of one file are coalesced only where they touch: a rank's slices of neighbouring
#: tensors are separated by the other ranks' slices, which it must not fetch
DEFAULT_TRANSFER = TransferOptions(coalesce_gap=0)


@dataclass(frozen=True)
class _Stored:
    """Where a tensor's bytes are (what torch's ``_StorageInfo`` says for an item)."""

    relative_path: str
    offset: int
    length: int


class SafetensorsReader(VolumeReader):
    """A DCP ``StorageReader`` over Hugging Face safetensors in any fsspec store.

    Args:
        url: a directory holding ``model.safetensors.index.json`` (its ``weight_map`` decides
            which file holds each tensor) or one or more ``*.safetensors`` files; or the URL
            of one ``.safetensors`` file or of an index.
        prefix: prepended to each tensor name to make its state-dict key (``"model."``).
        key_map: ``key_map(name) -> key or None`` instead of ``prefix``: the state-dict key
            of each tensor name, or None to leave the tensor out.
        storage_options: passed to fsspec unchanged; never logged.
        transfer: concurrency and coalescing of ranged GETs (default: ranges coalesced only
            where they touch, so a rank fetches no other rank's bytes).
        retry: retries of transient errors.
        cooperative: as for :class:`~dcp_volumes.VolumeReader`: bytes several ranks need
            (replicated state) are fetched once and sent over the process group.
        cooperative_timeout_s: as for :class:`~dcp_volumes.VolumeReader`.

    ``dcp.load`` checks that every key of the state dict is in the files (pass
    ``planner=DefaultLoadPlanner(allow_partial_load=True)`` to load a subset); tensors of
    the files that the state dict does not hold are not read.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        /,
        *,
        prefix: str | None = None,
        key_map: Callable[[str], str | None] | None = None,
        storage_options: dict[str, Any] | None = None,
        transfer: TransferOptions | None = None,
        retry: RetryOptions | None = None,
        cooperative: bool | Literal["auto"] = "auto",
        cooperative_timeout_s: float = 600.0,
    ) -> None:
        if prefix is not None and key_map is not None:
            raise errors.ConfigError("pass prefix= or key_map=, not both (key_map can add "
                                     "the prefix itself)")
        if prefix is not None and not isinstance(prefix, str):
            raise errors.ConfigError(f"prefix= must be a string, got {type(prefix).__name__}")
        if key_map is not None and not callable(key_map):
            raise errors.ConfigError("key_map= must be a function name -> key or None")
        self.prefix = prefix or ""
        self.key_map = key_map
        directory, self._named = _split(os.fspath(url))
        super().__init__(directory, storage_options=storage_options,
                         transfer=transfer or DEFAULT_TRANSFER, retry=retry,
                         cooperative=cooperative, cooperative_timeout_s=cooperative_timeout_s)

    def __repr__(self) -> str:
        named = f"/{self._named}" if self._named else ""
        return f"SafetensorsReader({redact_url(self.url)}{named!r})"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            directory, self._named = _split(os.fspath(checkpoint_id))
            checkpoint_id = directory
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP ``Metadata`` built from the files' headers (one chunk per tensor).

        Raises:
            CheckpointNotFoundError: no index and no ``*.safetensors`` at the URL.
            IntegrityError: the index or a header is damaged or does not fit its object, or
                a file the index names is missing.
            ConfigError: ``key_map`` returned something that is not a key, or two tensors
                map to one key.
        """
        if kwargs.get("rank") is not None:
            if self.last_error is not None:
                return _typed.deferred(self.last_error)  # raised in set_up_storage_reader
            raise errors.CheckpointNotFoundError(
                f"{redact_url(self.url)} holds safetensors: there is no per-rank metadata")
        return super().read_metadata(*args, **kwargs)

    def open_checkpoint(self) -> Opened:
        """The files' headers as ``.metadata`` and a manifest of raw entries (lengths only:
        safetensors has no checksums), and each file's version when its header was read:
        every tensor read is conditional on it, so a file replaced meanwhile fails the load
        with :class:`~dcp_volumes.errors.CheckpointChangedError` instead of giving the new
        file's bytes at the old header's offsets."""
        backend = self.backend()
        url = redact_url(self.url)
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, _Stored] = {}
        manifest = Manifest(save_id="safetensors", writer="safetensors", world_size=0)
        pins: dict[str, ObjectVersion] = {}
        seen: dict[str, str] = {}
        for relative, wanted in self._files(backend, url).items():
            pin = backend.run(lambda r=relative: backend.pin(r))  # type: ignore[misc]
            if pin is None:
                raise errors.IntegrityError(
                    f"{relative} of {url} is missing, but {INDEX_NAME} names it: upload it "
                    "again, or fix the index")
            pins[relative] = pin
            header = _format.read_header(_fetcher(backend, relative, pin), pin.size,
                                         f"{relative} of {url}")
            manifest.files[relative] = self._add(header, relative, wanted, url, pin.size,
                                                 (state, storage, seen))
        metadata = Metadata(state_dict_metadata=state, storage_data=storage,
                            storage_meta=StorageMeta(checkpoint_id=url,
                                                     load_id=_layout.new_save_id()))
        return Opened(metadata, manifest, verified=False, pins=pins)

    def _add(self, header: _format.Header, relative: str, wanted: frozenset[str] | None,
             url: str, size: int,
             into: tuple[dict[str, Any], dict[MetadataIndex, _Stored], dict[str, str]]
             ) -> FileEntry:
        """One file's tensors into the state's metadata and storage data; its manifest
        entry."""
        state, storage, seen = into
        entry_of = {e.name: e for e in header.entries}
        if wanted is not None:
            missing = sorted(wanted - set(entry_of))
            if missing:
                raise errors.IntegrityError(
                    f"{INDEX_NAME} of {url} puts tensor {missing[0]!r} in {relative}, "
                    "whose header does not have it: the index and the files disagree")
        file_entry = FileEntry(size=size)
        for e in header.entries:
            if wanted is not None and e.name not in wanted:
                continue
            key = self._key(e.name, seen, relative)
            if key is None:
                continue
            md, stored = _tensor(e, relative, header.data_start, f"{relative} of {url}")
            state[key] = md
            storage[MetadataIndex(key, md.chunks[0].offsets)] = stored
            file_entry.items[stored.offset] = ItemEntry.raw(
                stored.length, e.torch_dtype, e.shape, e.element_size)
        return file_entry

    def _key(self, name: str, seen: dict[str, str], relative: str) -> str | None:
        key = self.key_map(name) if self.key_map is not None else self.prefix + name
        if key is None:
            return None
        if not isinstance(key, str) or not key:
            raise errors.ConfigError(f"key_map({name!r}) returned {key!r}: return a non-empty "
                                     "string key, or None to leave the tensor out")
        if key in seen:
            raise errors.ConfigError(
                f"tensors {seen[key]!r} and {name!r} (in {relative}) both map to key {key!r}: "
                "make key_map (or the files) give each tensor its own key")
        seen[key] = name
        return key

    def _files(self, backend: Backend, url: str) -> dict[str, frozenset[str] | None]:
        """The files to read, each with the tensor names the index puts there (None: all)."""
        if self._named is not None and self._named.endswith(_SUFFIX):
            return {self._named: None}
        index = self._named or INDEX_NAME
        size = backend.run(lambda: backend.size(index))
        if size is not None:
            return _read_index(backend, index, size, url)
        if self._named is not None:
            raise errors.CheckpointNotFoundError(f"{url}/{index} does not exist")
        names = sorted(n for n in backend.run(backend.list_names) if n.endswith(_SUFFIX))
        if not names:
            raise errors.CheckpointNotFoundError(
                f"{url} holds neither {INDEX_NAME} nor any *.safetensors file: pass the "
                "directory of a Hugging Face model, or the URL of one .safetensors file")
        return {_file_name(n, url): None for n in names}


def _split(url: str) -> tuple[str, str | None]:
    """(the directory URL, the file named in the URL or None)."""
    stripped = url.rstrip("/")
    last = stripped.rsplit("/", 1)[-1]
    if last.endswith((_SUFFIX, ".json")) and "/" in stripped and url == stripped:
        return stripped.rsplit("/", 1)[0] or "/", last
    return url, None


def _fetcher(backend: Backend, relative: str, pin: ObjectVersion
             ) -> Callable[[int, int], bytes]:
    def fetch(start: int, end: int) -> bytes:
        return backend.run(lambda: backend.cat_pinned(relative, pin, start=start, end=end))
    return fetch


def _file_name(name: object, url: str) -> str:
    """A file name from the index or a listing: a plain ``*.safetensors`` name in the
    directory (no path, no URL)."""
    if (not isinstance(name, str) or not name.endswith(_SUFFIX) or len(name) > 255
            or "/" in name or name.startswith(".")):
        raise errors.UnsafeCheckpointError(
            f"{INDEX_NAME} of {url} names the file {str(name)[:80]!r}: only plain "
            "*.safetensors file names in the model's directory are read")
    return _layout.check_relative_path(name)


def _read_index(backend: Backend, index: str, size: int, url: str
                ) -> dict[str, frozenset[str] | None]:
    if size > MAX_INDEX_BYTES:
        raise errors.IntegrityError(
            f"{index} of {url} has {size} bytes, more than the {MAX_INDEX_BYTES} an index "
            "may have: it is damaged or not an index")
    data = backend.run(lambda: backend.cat(index))
    try:
        doc = json.loads(data)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is not a non-empty object")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise errors.IntegrityError(
            f"{index} of {url} is not a safetensors index (JSON with a weight_map from tensor "
            f"names to file names): {type(exc).__name__}") from None
    files: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(_file_name(file, url), set()).add(name)
    return {f: frozenset(names) for f, names in sorted(files.items())}


def _tensor(e: _format.TensorEntry, relative: str, data_start: int, what: str
            ) -> tuple[TensorStorageMetadata, _Stored]:
    dtype = getattr(torch, e.torch_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise errors.IntegrityError(f"{what}: tensor {e.name!r} has dtype {e.dtype}, which "
                                    f"this torch ({torch.__version__}) does not have")
    size = torch.Size(e.shape)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(e.shape)), sizes=size)
    md = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size,
                               chunks=[chunk])
    return md, _Stored(relative, data_start + e.begin, e.nbytes)
