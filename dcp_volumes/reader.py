"""``VolumeReader``: the DCP load lifecycle on any fsspec URL."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
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
from dcp_volumes.config import LocalTierOptions, RetryOptions, TransferOptions
from dcp_volumes.stats import LoadStats
from dcp_volumes.transfer import cooperative, transforms
from dcp_volumes.transfer.readplan import (
    Need,
    apply_need,
    direct_target,
    plan_needs,
    plan_ranges,
)
from dcp_volumes.transfer.serve import check_store, serve_store

__all__ = ["VolumeReader"]

logger = logging.getLogger(__name__)


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
        if (isinstance(cooperative_timeout_s, bool)
                or not isinstance(cooperative_timeout_s, (int, float))
                or not math.isfinite(cooperative_timeout_s) or cooperative_timeout_s <= 0):
            raise errors.ConfigError(
                f"cooperative_timeout_s= must be a number of seconds > 0, got "
                f"{cooperative_timeout_s!r}")
        self.cooperative_timeout_s = float(cooperative_timeout_s)
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
        if self._local_commit is not None:
            try:
                metadata, self._manifest = tier.parse_commit(self._local_commit, self._url)
            except errors.DCPVolumesError as exc:
                self.last_error = exc
                raise
            metadata.storage_meta.load_id = _layout.new_save_id()  # type: ignore[union-attr]
            return metadata
        stats = CallStats()
        try:
            # one read per job inside dcp.load over every rank (rank 0's, shared)
            committed = read_commit(self._backend(), with_manifest=self.verify, stats=stats,
                                    share=self.cooperative is not False,
                                    timeout_s=self.cooperative_timeout_s)
        except errors.DCPVolumesError as exc:
            # dcp.load folds this into an AssertionError message; keep the typed error for
            # dcp_volumes.load (and anyone holding the reader) to raise.
            self.last_error = exc
            raise
        finally:
            self._metadata_retries = stats.retries
        metadata = committed.metadata
        self._manifest = committed.manifest
        if self.verify and not committed.ours:
            logger.debug("%s was not written by VolumeWriter (no manifest): checksums are "
                         "not verified", redact_url(self._url))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = _layout.new_save_id()
        return metadata

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
        url = redact_url(self._url)
        start = time.monotonic()
        if isinstance(plan.storage_data, cooperative.Assignment):
            done = self._read_cooperative(plan, planner, plan.storage_data, url, start)
            if isinstance(done, Future):
                return done
            # every rank agreed to read directly (the plan changed after it was made)
            needs, local, remote = done
        else:
            needs, local, remote = self._read_tier(plan, planner, url)
        if self._local_commit is not None and (remote or local.fallback):
            missing = (remote + local.fallback)[0]
            raise errors.IntegrityError(
                f"rank {self._rank}: shard {missing.relative} of the local-only save of {url} "
                "has no usable local copy on this node (and no rank serves it), and the store "
                "has none: load the newest durable checkpoint instead")
        stats = CallStats()
        fetched, nranges = self._fetch_direct(remote + local.fallback, planner, url, stats)
        return self._done(LoadStats(
            rank=self._rank, bytes_needed=sum(n.needed for n in needs), bytes_fetched=fetched,
            items=len(needs), ranges=nranges, fetch_s=time.monotonic() - start,
            verified=self._verified,
            retries=stats.retries + self._metadata_retries,
            bytes_from_local=local.bytes_used, local_fallbacks=self._fallbacks(needs, local),
        ), url)

    @property
    def _sizes(self) -> dict[str, int] | None:
        """The shard files' sizes the checked manifest holds (no HEAD per file and rank)."""
        if self._manifest is None:
            return None
        return {name: entry.size for name, entry in self._manifest.files.items()}

    @property
    def _verified(self) -> bool:
        """Whether this load checks stored bytes against checksums (a manifest)."""
        return self._manifest is not None

    def _read_tier(self, plan: LoadPlan, planner: LoadPlanner, url: str
                   ) -> tuple[list[Need], tier.LocalRead, list[Need]]:
        """This rank's needs, applied from the local tier first: (all needs, what the tier
        did, the needs it does not hold). What fails there (and only that) goes to the store
        after."""
        needs = plan_needs(plan.items, self._storage_data, self._manifest, url,
                           self._metadata, self.extension_registry)
        local = self._read_local(needs, planner, url)
        return needs, local, _from_store(needs, frozenset(self._local))

    def _read_cooperative(self, plan: LoadPlan, planner: LoadPlanner,
                          assignment: cooperative.Assignment, url: str, start: float
                          ) -> Future[None] | tuple[list[Need], tier.LocalRead, list[Need]]:
        """This rank's part of a cooperative load; when the ranks agreed to read directly
        instead, what :meth:`_read_tier` found (the local tier is read either way)."""
        coop = cooperative.CooperativeRead(
            assignment, url=url, planner=planner, trusted=self.safe_globals,
            max_concurrency=self.transfer.max_concurrency,
            part_size=self.transfer.part_size, max_range_size=self.transfer.max_range_size,
            timeout_s=self.cooperative_timeout_s, local_files=self._local,
            store=self._local_commit is None, sizes=self._sizes,
        )
        needs: list[Need] = []
        local = tier.LocalRead()
        remote: list[Need] = []
        backend, failed = None, None
        try:
            backend = self._backend()
            needs, local, remote = self._read_tier(plan, planner, url)
            if self._local_commit is not None and local.fallback:
                raise errors.IntegrityError(
                    f"rank {self._rank}: the local copy of shard {local.fallback[0].relative} "
                    f"of the local-only save of {url} cannot be used (see the warning above), "
                    "and the store has none: load the newest durable checkpoint instead")
        except Exception as exc:  # noqa: BLE001 — coop.run reports it to every rank at once
            failed = exc
        figures = coop.run(backend, remote, failed=failed)
        if figures is None:
            return needs, local, remote
        stats = CallStats()
        fetched, nranges = self._fetch_direct(local.fallback, planner, url, stats)
        return self._done(LoadStats(
            rank=self._rank, bytes_needed=sum(n.needed for n in needs),
            bytes_fetched=figures.bytes_fetched + fetched, items=len(needs),
            ranges=figures.ranges + nranges, fetch_s=time.monotonic() - start,
            verified=self._verified,
            retries=figures.calls.retries + stats.retries + self._metadata_retries,
            cooperative=True, bytes_from_peers=figures.bytes_from_peers,
            bytes_to_peers=figures.bytes_to_peers, rounds=figures.rounds,
            peer_wait_s=figures.wait_s,
            bytes_from_local=local.bytes_used + figures.bytes_from_local,
            local_fallbacks=self._fallbacks(needs, local) + figures.local_fallbacks,
        ), url)

    def _read_local(self, needs: list[Need], planner: LoadPlanner, url: str
                    ) -> tier.LocalRead:
        """Apply the needs this node's local tier holds; the rest of them is returned."""
        mine = [n for n in needs if n.relative in self._local]
        for relative in sorted({n.relative for n in needs} & set(self._local_rejected)):
            logger.warning("local copy of shard %s of %s is not used: %s; reading it from "
                           "the store", relative, url, self._local_rejected[relative])
        if not mine:
            return tier.LocalRead()
        return tier.read_local(
            mine, self._local, gap=self.transfer.coalesce_gap,
            max_size=self.transfer.max_range_size, url=url,
            apply=lambda need, chunk: apply_need(need, chunk, planner, self.safe_globals),
            direct=lambda need: direct_target(need, planner),
            commit=lambda target: planner.commit_tensor(target.read, target.target))

    def _fallbacks(self, needs: list[Need], local: tier.LocalRead) -> int:
        rejected = sum(1 for n in needs if n.relative in self._local_rejected)
        return rejected + len(local.fallback)

    def _fetch_direct(self, needs: list[Need], planner: LoadPlanner, url: str,
                      stats: CallStats) -> tuple[int, int]:
        """Fetch, check and apply ``needs`` from the store; (bytes fetched, ranges)."""
        empty = [n for n in needs if n.start == n.end and n.first_block is not None]
        for need in empty:  # reads of no element of a raw tensor: nothing to fetch
            apply_need(need, memoryview(b""), planner, self.safe_globals)
        needs = [n for n in needs if not (n.start == n.end and n.first_block is not None)]
        if not needs:
            return 0, 0
        backend = self._backend()
        ranges = plan_ranges(needs, gap=self.transfer.coalesce_gap,
                             max_size=self.transfer.max_range_size)
        check_store(backend, ranges, url, self._sizes)
        fetched = serve_store(
            backend, ranges, url=url,
            apply=lambda need, chunk: apply_need(need, chunk, planner, self.safe_globals),
            max_concurrency=self.transfer.max_concurrency, chunk_size=self.transfer.part_size,
            stats=stats)
        return fetched, len(ranges)

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


def _from_store(needs: list[Need], local_files: frozenset[str]) -> list[Need]:
    """The needs not served by the rank's local tier (the files it found there)."""
    if not local_files:
        return needs
    return [n for n in needs if n.relative not in local_files]
