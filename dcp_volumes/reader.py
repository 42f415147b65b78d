"""``VolumeReader``: the DCP load lifecycle on any fsspec URL."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_volumes import _compat, _layout, _typed, errors, tier
from dcp_volumes._location import Location
from dcp_volumes._manifest import Manifest
from dcp_volumes._reader_args import (
    checked_cooperative,
    checked_local_commit,
    checked_local_tier,
    checked_safe_globals,
    checked_timeout,
)
from dcp_volumes._shared_commit import read_commit
from dcp_volumes.backends import CallStats, redact_url
from dcp_volumes.backends.versions import ObjectVersion
from dcp_volumes.config import LocalTierOptions, RetryOptions, TransferOptions
from dcp_volumes.loading import cooperative
from dcp_volumes.loading.cooperative.coordinate import coordinate
from dcp_volumes.loading.rank_read import RankRead
from dcp_volumes.stats import LoadStats
from dcp_volumes.transfer import transforms

__all__ = ["Opened", "VolumeReader"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Opened:
    """What a load is planned from (:meth:`VolumeReader.open_checkpoint`).

    Attributes:
        metadata: DCP's ``Metadata`` (its ``storage_data`` says where each item is stored).
        manifest: sizes and checksums of the stored items (None: torch's own format,
            nothing to check against).
        verified: whether the bytes are checked against checksums (``LoadStats.verified``).
        pins: the versions of the objects the metadata was built from, by relative path:
            every read of them is conditional on it (a format without checksums), or None.
    """

    metadata: Metadata
    manifest: Manifest | None
    verified: bool
    pins: Mapping[str, ObjectVersion] | None = None


class VolumeReader(Location, StorageReader):
    """A DCP ``StorageReader`` for any fsspec URL, verifying checksums when present.

    Reads checkpoints written by :class:`~dcp_volumes.VolumeWriter` (checksums verified)
    and by torch's own ``FileSystemWriter``/``FsspecWriter`` (no checksums to verify).

    Args:
        path: checkpoint URL, as for :class:`~dcp_volumes.VolumeWriter`.
        storage_options: passed to fsspec unchanged; never logged.
        transfer: concurrency of ranged GETs and range coalescing (:class:`TransferOptions`).
        retry: retries of transient errors (:class:`RetryOptions`).
        verify: check each item's CRC32C and length against the manifest (default True).
        safe_globals: classes and functions that pickled non-tensor items (``extra`` state,
            config objects) may reference, on top of what torch's weights-only unpickler
            allows (containers, numbers, strings, tensors). An item that references
            anything else is refused with :class:`~dcp_volumes.errors.UnsafeCheckpointError`
            before it is unpickled: loading a checkpoint never runs code from storage.
        cooperative: when several ranks need the same stored bytes (replicated state: DDP,
            HSDP replicas), fetch each byte range once, on one of them, check it there and
            send it to the others over the process group (gloo, CPU tensors).
            ``"auto"`` (default): when ``dcp.load`` runs on the default process group and
            some bytes are needed by more than one rank; otherwise direct reads.
            ``True``: the same, but say in a WARNING why a load reads directly.
            ``False``: every rank reads what it needs itself.
        cooperative_timeout_s: in a cooperative load, the longest a rank waits for the
            others at one step (a status report, one round's exchange) before it raises
            :class:`~dcp_volumes.errors.DownloadError`: a rank that died or hangs fails the
            load on every rank instead of stalling it.
        local_tier: read what this node's local tier holds of the committed save (as kept
            by a :class:`~dcp_volumes.VolumeWriter` with the same :class:`LocalTierOptions`)
            from local disk, and only the rest from the store. The store's ``.metadata`` and
            manifest are read as always and decide which save that is; every byte from local
            disk is checked against the manifest's CRC32C, and a missing, wrong-size, linked
            or corrupt local copy is read from the store instead (a WARNING, counted in
            ``LoadStats.local_fallbacks``). In a cooperative load a rank also reads the
            ranges other ranks need of the files it holds and sends them (checked first;
            ``LoadStats.bytes_from_peers`` on the receiving side). Needs ``verify=True``.
        local_commit: load a **local-only** save (as ``Checkpointer.load_latest`` finds
            one): its ``.metadata`` and manifest are these bytes instead of the store's, and
            every shard byte must come from a local tier (this node's or a peer's, checked
            against that manifest); a byte no rank holds fails the load with
            :class:`~dcp_volumes.errors.IntegrityError`.
        extension_registry: torch's ``ExtensionRegistry``
            (``torch.distributed.checkpoint._extension``) with the custom stream transforms
            a torch ``FileSystemWriter(..., _extensions=[...])`` wrote through registered,
            as torch's ``FileSystemReader(..., _extension_registry=...)`` takes it. Such
            items are decoded after their checksum check, bounded like zstd's (by the
            item's metadata and bytes held). ``stream.zstd`` needs no registry; without one,
            any other transform raises :class:`~dcp_volumes.errors.UnsupportedTransformError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        /,
        *,
        storage_options: dict[str, Any] | None = None,
        transfer: TransferOptions | None = None,
        retry: RetryOptions | None = None,
        verify: bool = True,
        safe_globals: Sequence[Any] = (),
        cooperative: bool | Literal["auto"] = "auto",
        cooperative_timeout_s: float = 600.0,
        local_tier: LocalTierOptions | None = None,
        local_commit: tier.LocalCommit | None = None,
        extension_registry: Any = None,
    ) -> None:
        super().__init__()
        self._init_location(path, storage_options, retry)
        self.transfer = transfer or TransferOptions()
        self.verify = bool(verify)
        self.safe_globals = checked_safe_globals(safe_globals)
        self.extension_registry = transforms.checked_registry(extension_registry)
        self.cooperative: bool | Literal["auto"] = checked_cooperative(cooperative)
        self.cooperative_timeout_s = checked_timeout(cooperative_timeout_s)
        self.local_tier = checked_local_tier(local_tier, verify=self.verify)
        self._local: dict[str, tier.LocalFile] = {}
        self._local_rejected: dict[str, str] = {}
        self._storage_data: dict[Any, Any] = {}
        self._metadata: Metadata | None = None
        self._manifest: Manifest | None = None
        self._verified = False  # whether the load checks stored bytes against checksums
        self._pins: Mapping[str, ObjectVersion] | None = None
        self._rank = 0
        self.last_stats: LoadStats | None = None
        #: the typed error of the last failed read_metadata/read_data on this rank
        self.last_error: errors.DCPVolumesError | None = None
        self._metadata_retries = 0  # retries of the .metadata and manifest reads
        self._local_commit = checked_local_commit(local_commit)

    def __repr__(self) -> str:
        return f"VolumeReader({redact_url(self._url)!r})"

    # ---- StorageReader -----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._switch_url(checkpoint_id)
        self._storage_data = {}
        self._manifest = None
        self._local, self._local_rejected = {}, {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` (allow-listed unpickling) and the integrity manifest.

        Raises:
            CheckpointNotFoundError: nothing is stored at the URL.
            IncompleteCheckpointError: shards exist but ``.metadata`` does not.
            UnsafeCheckpointError: ``.metadata`` names classes or paths it must not.
        """
        if kwargs.get("rank") is not None:
            # DCP asks for per-rank metadata when the global one failed; we never write it.
            if self.last_error is not None:
                return _typed.deferred(self.last_error)  # raised in set_up_storage_reader
            raise errors.CheckpointNotFoundError(
                f"{redact_url(self._url)} has no per-rank metadata (VolumeWriter writes one "
                "global .metadata)"
            )
        self.last_error = None
        try:
            opened = self.open_checkpoint()
        except errors.DCPVolumesError as exc:
            # dcp.load folds this into an AssertionError message; keep the typed error for
            # dcp_volumes.load (and anyone holding the reader) to raise.
            self.last_error = exc
            raise
        self._manifest, self._verified, self._pins = opened.manifest, opened.verified, opened.pins
        metadata = opened.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = _layout.new_save_id()
        return metadata

    def open_checkpoint(self) -> Opened:
        """What this load is planned from (``read_metadata``'s work): the committed
        ``.metadata`` and manifest from the store, or a local-only save's commit bytes.
        A reader of another format overrides this (:class:`~dcp_volumes.export.
        SafetensorsReader` builds them from the files' headers)."""
        if self._local_commit is not None:
            metadata, manifest = tier.parse_commit(self._local_commit, self._url)
            return Opened(metadata, manifest, verified=True)
        stats = CallStats()
        try:
            # one read per job inside dcp.load over every rank (rank 0's, shared)
            committed = read_commit(self.backend(), with_manifest=self.verify, stats=stats,
                                    share=self.cooperative is not False,
                                    timeout_s=self.cooperative_timeout_s)
        finally:
            self._metadata_retries = stats.retries
        if self.verify and not committed.ours:
            logger.debug("%s was not written by VolumeWriter (no manifest): checksums are "
                         "not verified", redact_url(self._url))
        return Opened(committed.metadata, committed.manifest,
                      verified=committed.manifest is not None)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        _typed.raise_deferred(metadata)  # the typed error read_metadata() recorded
        if metadata.storage_data is None:
            raise errors.IntegrityError(f"{redact_url(self._url)}: .metadata has no storage_data")
        self._storage_data = metadata.storage_data
        self._metadata = metadata
        self._rank = _compat.storage_rank(kwargs)
        self.last_stats = None
        self._local, self._local_rejected = {}, {}
        if self.local_tier is not None and self._manifest is not None:
            # once per load, before any plan: the cooperative plan leaves these files out
            self._local, self._local_rejected = tier.find_local(
                self.local_tier, self._url, self._manifest)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self.cooperative is False:
            return plan
        # what the coordinator needs to plan a cooperative load: who and where this rank is,
        # and which shard files it reads from its local tier (left out of the plan)
        return dataclasses.replace(plan, storage_data=cooperative.local_info(
            frozenset(self._local)))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Plan a cooperative load when the ranks share bytes (see ``cooperative=``)."""
        if self.cooperative is False:
            return plans
        return coordinate(plans, mode=self.cooperative, storage_data=self._storage_data,
                          manifest=self._manifest, metadata=self._metadata,
                          extension_registry=self.extension_registry, transfer=self.transfer,
                          url=redact_url(self._url))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_data(plan, planner)
        except errors.DCPVolumesError as exc:
            self.last_error = exc
            raise

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's needs, nearest source first (:class:`~dcp_volumes.loading.rank_read.
        RankRead`)."""
        url = redact_url(self._url)
        stats = RankRead(
            url=url, backend=self.backend, transfer=self.transfer,
            storage_data=self._storage_data, manifest=self._manifest, metadata=self._metadata,
            extension_registry=self.extension_registry, trusted=self.safe_globals,
            timeout_s=self.cooperative_timeout_s, local=self._local,
            local_rejected=self._local_rejected, local_only=self._local_commit is not None,
            pins=self._pins, verified=self._verified, rank=self._rank,
            metadata_retries=self._metadata_retries,
        ).run(plan, planner)
        return self._done(stats, url)

    def _done(self, s: LoadStats, url: str) -> Future[None]:
        self.last_stats = s
        local = (f", {s.bytes_from_local} from the local tier ({s.local_fallbacks} items "
                 "read from the store instead)" if self.local_tier is not None else "")
        peers = (f", {s.bytes_from_peers} from other ranks and {s.bytes_to_peers} to them "
                 f"in {s.rounds} rounds (waited {s.peer_wait_s:.2f}s)" if s.cooperative else "")
        logger.info("rank %d read %d bytes (%d needed) in %d ranges from %s%s: %.2fs, "
                    "%.1f MiB/s, %d retries, checksums %s", s.rank, s.bytes_fetched,
                    s.bytes_needed, s.ranges, url, local + peers, s.fetch_s, s.mib_per_s,
                    s.retries, "verified" if s.verified else "not available")
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
