"""``VolumeReader``: the DCP load lifecycle on any fsspec URL."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_volumes import _compat, _layout, _typed, errors, tier
from dcp_volumes._location import Location
from dcp_volumes._manifest import Manifest
from dcp_volumes._shared_commit import read_commit
from dcp_volumes.backends import CallStats, redact_url
from dcp_volumes.backends.versions import ObjectVersion
from dcp_volumes.config import LocalTierOptions, RetryOptions, TransferOptions
from dcp_volumes.loading import cooperative
from dcp_volumes.loading.apply import PlannerTarget
from dcp_volumes.loading.direct import TierRead, read_store, read_tier
from dcp_volumes.loading.needs import Need, plan_needs
from dcp_volumes.loading.sources import LocalTierSource, StoreSource
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
        if isinstance(safe_globals, (str, bytes)) or not isinstance(safe_globals, Sequence):
            raise errors.ConfigError(
                "safe_globals= must be a list of classes/functions (as for "
                f"torch.serialization.add_safe_globals), got {type(safe_globals).__name__}")
        self.safe_globals = tuple(safe_globals)
        self.extension_registry = transforms.checked_registry(extension_registry)
        if cooperative not in (True, False, "auto"):
            raise errors.ConfigError(
                f"cooperative= must be True, False or 'auto', got {cooperative!r}")
        self.cooperative: bool | Literal["auto"] = cooperative
        self.cooperative_timeout_s = _seconds(cooperative_timeout_s)
        if local_tier is not None and not isinstance(local_tier, LocalTierOptions):
            raise errors.ConfigError(
                f"local_tier= must be a LocalTierOptions or None, got {type(local_tier).__name__}")
        if local_tier is not None and not self.verify:
            raise errors.ConfigError(
                "local_tier= needs verify=True: local copies are used only when every byte "
                "can be checked against the committed manifest")
        self.local_tier = local_tier
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
        if local_commit is not None and not isinstance(local_commit, tier.LocalCommit):
            raise errors.ConfigError(
                "local_commit= must be a LocalCommit (from a local-only save found in the "
                f"local tier) or None, got {type(local_commit).__name__}")
        self._local_commit = local_commit

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
        url = redact_url(self._url)
        try:
            # a rank reads what it needs of its local files itself (left out here), and
            # serves those files to the ranks that need them
            needs = [_from_store(plan_needs(p.items, self._storage_data, self._manifest, url,
                                            self._metadata, self.extension_registry),
                                 getattr(p.storage_data, "local_files", frozenset()))
                     for p in plans]
        except errors.DCPVolumesError as exc:
            # the rank concerned raises it in read_data, with its own reads at hand
            logger.debug("no cooperative load of %s: %s", url, exc)
            return plans
        assigned, why = cooperative.assign(
            needs, [p.storage_data for p in plans], unit_bytes=self.transfer.part_size,
            gap=self.transfer.coalesce_gap)
        if assigned is None or isinstance(why, str):
            log = logger.warning if self.cooperative is True and len(plans) > 1 else logger.debug
            log("%s: every rank reads directly: %s", url, why)
            return plans
        logger.info("cooperative load of %s on %d ranks: %d unique bytes (%d shared, %d read "
                    "from local tiers) read once instead of %d, in %d bundles and %d rounds",
                    url, why.ranks, why.unique_bytes, why.shared_bytes, why.local_bytes,
                    why.direct_bytes, why.bundles, why.rounds)
        return [dataclasses.replace(p, storage_data=a) for p, a in zip(plans, assigned)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_data(plan, planner)
        except errors.DCPVolumesError as exc:
            self.last_error = exc
            raise

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's needs: from its local tier first, then from the peers (cooperative:
        the bytes several ranks need) or the store."""
        url = redact_url(self._url)
        start = time.monotonic()
        target = PlannerTarget(planner, self.safe_globals)
        coop = plan.storage_data if isinstance(plan.storage_data, cooperative.Assignment) \
            else None
        if coop is None:
            tiered = self._read_tier(plan, target, url, cooperative=False)
            figures = None
        else:
            tiered, figures = self._read_cooperative(plan, planner, coop, target, url)
        store_needs = tiered.fallback if figures is not None else \
            tiered.fallback + tiered.elsewhere
        self._only_local(store_needs, url)
        store = self._store(url) if store_needs else None
        nranges = read_store(store_needs, store, target, gap=self.transfer.coalesce_gap,
                             max_size=self.transfer.max_range_size, url=url) if store else 0
        fig = figures or cooperative.ExchangeFigures()
        return self._done(LoadStats(
            rank=self._rank, bytes_needed=sum(n.needed for n in tiered.needs),
            bytes_fetched=fig.bytes_fetched + (store.fetched if store else 0),
            items=len(tiered.needs), ranges=fig.ranges + nranges,
            fetch_s=time.monotonic() - start, verified=self._verified,
            retries=(fig.calls.retries + (store.stats.retries if store else 0)
                     + self._metadata_retries),
            cooperative=figures is not None, bytes_from_peers=fig.bytes_from_peers,
            bytes_to_peers=fig.bytes_to_peers, rounds=fig.rounds, peer_wait_s=fig.wait_s,
            bytes_from_local=tiered.bytes_used + fig.bytes_from_local,
            local_fallbacks=self._fallbacks(tiered) + fig.local_fallbacks,
        ), url)

    @property
    def _sizes(self) -> dict[str, int] | None:
        """The shard files' sizes the checked manifest holds (no HEAD per file and rank)."""
        if self._manifest is None:
            return None
        return {name: entry.size for name, entry in self._manifest.files.items()}

    def _store(self, url: str) -> StoreSource:
        return StoreSource(self.backend(), url, max_concurrency=self.transfer.max_concurrency,
                           chunk_size=self.transfer.part_size, stats=CallStats(),
                           pins=self._pins, sizes=self._sizes)

    def _read_tier(self, plan: LoadPlan, target: PlannerTarget, url: str, *,
                   cooperative: bool) -> _Tiered:
        """This rank's needs, applied from the local tier first. What the store must serve
        after (and, without ``cooperative``, what the tier does not hold) is checked here
        against a local-only save, which has no store copy."""
        needs = plan_needs(plan.items, self._storage_data, self._manifest, url,
                           self._metadata, self.extension_registry)
        for relative in sorted({n.relative for n in needs} & set(self._local_rejected)):
            logger.warning("local copy of shard %s of %s is not used: %s; reading it from "
                           "the store", relative, url, self._local_rejected[relative])
        read = read_tier(needs, LocalTierSource(self._local, url), target,
                         gap=self.transfer.coalesce_gap, max_size=self.transfer.max_range_size,
                         url=url)
        tiered = _Tiered(read.bytes_used, read.fallback, read.elsewhere, needs)
        self._only_local(tiered.fallback + ([] if cooperative else tiered.elsewhere), url)
        return tiered

    def _only_local(self, to_store: list[Need], url: str) -> None:
        """A local-only save has no store copy: a need left to the store fails the load."""
        if self._local_commit is not None and to_store:
            raise errors.IntegrityError(
                f"rank {self._rank}: shard {to_store[0].relative} of the local-only save of "
                f"{url} has no usable local copy on this node (and no rank serves it), and "
                "the store has none: load the newest durable checkpoint instead")

    def _read_cooperative(self, plan: LoadPlan, planner: LoadPlanner,
                          assignment: cooperative.Assignment, target: PlannerTarget, url: str
                          ) -> tuple[_Tiered, cooperative.ExchangeFigures | None]:
        """This rank's part of a cooperative load, after its local tier's: what the tier
        did, and the exchange's figures (None when the ranks agreed to read directly)."""
        coop = cooperative.CooperativeRead(
            assignment, url=url, planner=planner, trusted=self.safe_globals,
            max_concurrency=self.transfer.max_concurrency,
            part_size=self.transfer.part_size, max_range_size=self.transfer.max_range_size,
            timeout_s=self.cooperative_timeout_s, local_files=self._local,
            store=self._local_commit is None, sizes=self._sizes, pins=self._pins,
        )
        tiered, backend, failed = _Tiered(), None, None
        try:
            backend = self.backend()
            tiered = self._read_tier(plan, target, url, cooperative=True)
        except Exception as exc:  # noqa: BLE001 — coop.run reports it to every rank at once
            failed = exc
        return tiered, coop.run(backend, tiered.elsewhere, failed=failed)

    def _fallbacks(self, tiered: _Tiered) -> int:
        rejected = sum(1 for n in tiered.needs if n.relative in self._local_rejected)
        return rejected + len(tiered.fallback)

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


def _seconds(value: Any) -> float:
    """``cooperative_timeout_s=``, checked."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise errors.ConfigError(
            f"cooperative_timeout_s= must be a number of seconds > 0, got {value!r}")
    return float(value)


@dataclasses.dataclass
class _Tiered(TierRead):
    """This rank's needs, and what its local tier did with them."""

    needs: list[Need] = dataclasses.field(default_factory=list)


def _from_store(needs: list[Need], local_files: frozenset[str]) -> list[Need]:
    """The needs not served by the rank's local tier (the files it found there)."""
    if not local_files:
        return needs
    return [n for n in needs if n.relative not in local_files]
