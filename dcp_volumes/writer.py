"""``VolumeWriter``: the DCP save lifecycle on any fsspec URL.

This module holds the lifecycle (plan → write → finish) and its two destinations: the store
(a durable save) or the ranks' local tiers only (``local_only=True``, chosen at
construction). What a rank writes is :mod:`dcp_volumes.saving` (spool, upload stream, local
tier); layout, the manifest and the commit live in their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_volumes import _commit, _compat, _layout, _live, errors
from dcp_volumes._location import Location
from dcp_volumes.backends import CallStats, redact_url
from dcp_volumes.config import (
    LocalTierOptions,
    RetryOptions,
    SpoolOptions,
    TransferOptions,
    check_local_tier,
)
from dcp_volumes.saving import (
    RankJob,
    StagingBuffers,
    begin_store_save,
    claim_shard_id,
    commit_bytes,
    commit_store_save,
    complete_local_only,
    write_local_only,
    write_to_store,
)
from dcp_volumes.stats import SaveStats
from dcp_volumes.tier import DurableBase, LocalCommit, TierSave, normal_url

__all__ = ["VolumeWriter"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _SavePrefix:
    """What the coordinator hands every rank in its plan: the save id and the rank's index.

    With ``DefaultSavePlanner(enable_plan_caching=True)`` a rank whose plan did not change
    gets its first save's final plan back, this prefix included: a stale save id. So the
    id a rank names its shards with is claimed in :meth:`VolumeWriter.write_data` (see
    :func:`dcp_volumes.saving._shards.claim_shard_id`), never taken from the plan blindly.
    """

    save_id: str
    rank: int


class VolumeWriter(Location, StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` for any fsspec URL: spool, concurrent upload, commit last.

    Example::

        writer = VolumeWriter("s3://bucket/run-42/step-1000",
                              storage_options={"endpoint_url": "http://127.0.0.1:8333"})
        dcp.save(state_dict, storage_writer=writer)
        print(writer.last_stats)

    Args:
        path: checkpoint URL (``s3://``, ``gs://``, ``az://``/``abfs://``, ``file://`` or a
            plain path, ``memory://``, or any installed fsspec protocol).
        storage_options: passed to fsspec unchanged (credentials, ``endpoint_url``, ...);
            never logged.
        overwrite: replace an existing complete checkpoint. Off by default: saving onto a
            complete checkpoint raises :class:`~dcp_volumes.errors.CheckpointExistsError`
            before any byte is uploaded.
        spool: where shards are serialized before upload (:class:`SpoolOptions`).
        transfer: part size and concurrency (:class:`TransferOptions`).
        retry: retries of transient errors (:class:`RetryOptions`).
        local_tier: keep each rank's shard files on node-local disk after they uploaded
            (:class:`LocalTierOptions`), so a :class:`VolumeReader` with the same option
            restores from there. Needs ``SpoolOptions(mode="disk")``. A failure in the tier
            (full, unwritable) is a WARNING; the save still completes in the store.
        local_only: write each rank's files, the ``.metadata`` and the manifest to the local
            tier only; nothing goes to the store. After ``dcp.save`` returned, every rank
            asks :meth:`local_only_result`, which completes the save in every rank's tier
            (the :class:`~dcp_volumes.Checkpointer` does, ``save(..., local_only=True)``).
            Needs ``local_tier=``.

    With ``dcp.async_save`` the writer is also the stager: it copies the state dict into CPU
    buffers allocated on the first save and reused by later ones (never while a save that
    reads them is still running), so the training loop blocks only for a memory copy. The
    buffers belong to the process, keyed by the state's layout: a fresh writer per step
    reuses them too (:func:`dcp_volumes.release_staging_buffers` frees them).
    """

    # Staging is a blocking copy: nothing to synchronize after async_save returns.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        /,
        *,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        spool: SpoolOptions | None = None,
        transfer: TransferOptions | None = None,
        retry: RetryOptions | None = None,
        local_tier: LocalTierOptions | None = None,
        local_only: bool = False,
    ) -> None:
        super().__init__()
        self._init_location(path, storage_options, retry)
        self.overwrite = bool(overwrite)
        self.spool = spool or SpoolOptions()
        self.transfer = transfer or TransferOptions()
        for name, value, cls in (("spool", self.spool, SpoolOptions),
                                 ("transfer", self.transfer, TransferOptions)):
            if not isinstance(value, cls):
                raise errors.ConfigError(f"{name}= must be a {cls.__name__}, got {type(value).__name__}")
        self.local_tier = check_local_tier(local_tier, self.spool)
        self.local_only = _check_local_only(local_only, self.local_tier)
        self._rank = 0
        self._save_id: str | None = None
        self._replaces: str | None = None  # a damaged .metadata the commit may replace
        self.last_stats: SaveStats | None = None
        #: the coordinator's last durable commit (None before one, and on other ranks)
        self.last_commit: DurableBase | None = None
        self._staging = StagingBuffers()
        # local-only: write_data leaves each rank's files in the tier without a descriptor
        # (_local_pending), finish leaves the coordinator's commit bytes (_local_commit);
        # local_only_result completes the save once and keeps its answer (_local_result,
        # None until then)
        self._local_pending: TierSave | None = None
        self._local_commit: LocalCommit | None = None
        self._local_result: bool | None = False

    # ---- pickling (AsyncCheckpointerType.PROCESS): config only -------------------------
    def __getstate__(self) -> dict[str, Any]:
        # Being pickled means a save runs in another process that reads our staged buffers
        # where we cannot see it finish: drop them, never reuse (see _staging).
        self._staging.disable_reuse()
        state = super().__getstate__()
        state["_staging"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._staging = StagingBuffers()

    # ---- AsyncStager ---------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into reusable CPU buffers (called by ``dcp.async_save``)."""
        return self._staging.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns after the copy is complete."""

    def close(self) -> None:
        """Free the staging buffers this writer staged into last (once no save reads them).

        The buffers belong to the process and outlive the writer, so that a fresh writer per
        step reuses them; :func:`dcp_volumes.release_staging_buffers` frees all of them.
        """
        self._staging.close()

    def __repr__(self) -> str:
        return (f"VolumeWriter({redact_url(self._url)!r}, overwrite={self.overwrite}, "
                f"local_only={self.local_only})")

    # ---- StorageWriter -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._switch_url(checkpoint_id)
        self._save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = _compat.storage_rank(kwargs)
        self.last_stats = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=redact_url(self._url))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # With plan caching, ranks whose plan did not change send SavePlan([], usable=False)
        # and reuse their cached plan: empty is an error only when no plan is cached.
        if not any(p.items for p in plans) and all(p.usable for p in plans):
            raise errors.ConfigError(
                f"the state dict is empty on every rank: nothing to save to "
                f"{redact_url(self._url)}; pass the model/optimizer state you mean to checkpoint"
            )
        if self.local_only:  # no network: no existence check, no live record
            save_id, replaces = _layout.new_save_id(), None
        else:
            save_id, replaces = begin_store_save(self.backend(), self._url,
                                                 overwrite=self.overwrite)
        self._replaces = replaces  # a damaged .metadata this save may replace
        self._save_id = save_id
        return [dataclasses.replace(p, storage_data=_SavePrefix(save_id, i))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        if not isinstance(prefix, _SavePrefix):
            raise errors.DCPVolumesError(
                "the save plan carries no dcp_volumes prefix: VolumeWriter.prepare_global_plan "
                "did not run (is a custom planner dropping storage_data?)"
            )
        shard_id = claim_shard_id(prefix.save_id, self._save_id)
        if shard_id != prefix.save_id:
            logger.debug("rank %d: the plan carries save id %s of an earlier save (a cached "
                         "plan); naming this save's shards %s", self._rank, prefix.save_id,
                         shard_id)
        job = RankJob(plan.items, planner, self._url, self._rank, prefix.rank, shard_id,
                      self.spool, self.transfer, self.local_tier)
        try:
            if self.local_only:
                self._local_pending, self._local_result = None, None
                results, self.last_stats, self._local_pending = write_local_only(job)
            else:
                results = self._write_live(job, plan_save_id=prefix.save_id)
        finally:
            # the save has finished reading the staged buffers: they may be handed out again
            self._staging.finished_reading(plan.items, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_live(self, job: RankJob, *, plan_save_id: str) -> list[WriteResult]:
        """:func:`~dcp_volumes.saving._durable.write_to_store`, keeping the live record of the
        id in this rank's shard names fresh meanwhile (so gc leaves those objects alone). A
        rank that fails removes the record: DCP commits a save only if every rank
        succeeded, so what this save wrote is garbage now. A rank-local id's record (a
        cached plan, see ``claim_shard_id``) is also removed on success: the coordinator
        removes only the save id's."""
        backend = self.backend()
        heartbeat = _live.Heartbeat(backend, job.shard_id).start()
        try:
            results, self.last_stats = write_to_store(job, backend)
        except BaseException:
            heartbeat.stop()
            with contextlib.suppress(Exception):  # best effort: gc collects a stale record
                backend.run(lambda: _live.end_live(backend, job.shard_id))
            raise
        finally:
            heartbeat.stop()
        if job.shard_id != plan_save_id and heartbeat.beats:
            with contextlib.suppress(Exception):
                backend.run(lambda: _live.end_live(backend, job.shard_id))
        return results

    def local_only_result(self, *, group: dist.ProcessGroup | None = None,
                          base: Callable[[], DurableBase | None] = lambda: None) -> bool:
        """Whether this rank's copy of the local-only save that just ran is complete.

        ``dcp.save`` gives the save's ``.metadata`` and manifest to the coordinator only, and
        every rank's copy needs them: the first call after the save completes it, a
        collective over ``group`` (every rank of the save calls it, after ``dcp.save``
        returned) that sends them to every rank, which writes them and its descriptor
        last. ``base`` is asked on the coordinator only: the durable checkpoint the save
        continues (recorded with it). A rank that cannot complete its copy logs a WARNING
        and gets False; later calls give the same answer without a collective.
        """
        if self._local_result is None:
            tier, self._local_pending = self._local_pending, None
            commit, self._local_commit = self._local_commit, None
            self._local_result = complete_local_only(tier, commit, base=base, group=group)
        return self._local_result

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._save_id is None:
            raise errors.DCPVolumesError("finish() called without prepare_global_plan()")
        save_id = self._save_id
        start = time.monotonic()
        manifest, metadata_bytes = commit_bytes(metadata, results, save_id=save_id,
                                                url=self._url)
        if self.local_only:
            # completed on every rank by local_only_result, which broadcasts these bytes
            self._local_commit = LocalCommit(save_id, metadata_bytes, manifest.to_json())
            return
        backend = self.backend()
        stats = CallStats()
        superseded = commit_store_save(backend, manifest, metadata_bytes,
                                       overwrite=self.overwrite, replaces=self._replaces,
                                       stats=stats)
        commit_s = time.monotonic() - start
        self.last_commit = DurableBase(normal_url(self._url), save_id, manifest.sha256)
        _commit.remove_superseded(backend, superseded)
        prev = self.last_stats or SaveStats(rank=self._rank)
        self.last_stats = dataclasses.replace(prev, commit_s=commit_s,
                                              retries=prev.retries + stats.retries)
        logger.info("committed %s (save %s, %d files) in %.2fs", redact_url(self._url),
                    save_id, len(manifest.files), commit_s)


def _check_local_only(local_only: object, local_tier: LocalTierOptions | None) -> bool:
    if not isinstance(local_only, bool):
        raise errors.ConfigError(f"local_only= must be True or False, got {local_only!r}")
    if local_only and local_tier is None:
        raise errors.ConfigError(
            "local_only=True writes to the local tier only, and no local_tier= is given: "
            "pass local_tier=LocalTierOptions(directory=...)")
    return local_only
