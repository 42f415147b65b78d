"""``VolumeWriter``: the DCP save lifecycle on any fsspec URL.

This module holds the lifecycle (plan → write → finish) and its two destinations: the store
(a durable save) or the ranks' local tiers only (``local_only=True``, chosen at
construction). The spool loop is :mod:`dcp_volumes._shards`; transfer, layout, the manifest
and the commit live in their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import threading
import time
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_volumes import _commit, _compat, _layout, errors
from dcp_volumes._complete import completeness
from dcp_volumes._location import Location
from dcp_volumes._manifest import Manifest, manifest_of, paused_gc, set_save_id
from dcp_volumes._shards import ShardFiles, claim_shard_id, item_nbytes, spool_items
from dcp_volumes._spool import SpoolFile, check_free_space, remove_dead_spools
from dcp_volumes._staging import StagingBuffers
from dcp_volumes._version import __version__
from dcp_volumes.backends import CallStats, redact_url
from dcp_volumes.config import (
    LocalTierOptions,
    RetryOptions,
    SpoolOptions,
    TransferOptions,
    check_local_tier,
)
from dcp_volumes.stats import SaveStats
from dcp_volumes.tier import DurableBase, LocalCommit, TierSave, normal_url
from dcp_volumes.transfer.upload import Uploader

__all__ = ["VolumeWriter"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _SavePrefix:
    """What the coordinator hands every rank in its plan: the save id and the rank's index.

    With ``DefaultSavePlanner(enable_plan_caching=True)`` a rank whose plan did not change
    gets its first save's final plan back, this prefix included: a stale save id. So the
    id a rank names its shards with is claimed in :meth:`VolumeWriter.write_data` (see
    :func:`dcp_volumes._shards.claim_shard_id`), never taken from the plan blindly.
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
            tier only; nothing goes to the store. The coordinator's commit bytes are handed
            back by :meth:`take_local_commit` and every rank completes its copy with
            :meth:`complete_local_only` (the :class:`~dcp_volumes.Checkpointer` does both,
            ``save(..., local_only=True)``). Needs ``local_tier=``.

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
        if not isinstance(local_only, bool):
            raise errors.ConfigError(f"local_only= must be True or False, got {local_only!r}")
        if local_only and self.local_tier is None:
            raise errors.ConfigError(
                "local_only=True writes to the local tier only, and no local_tier= is given: "
                "pass local_tier=LocalTierOptions(directory=...)")
        self.local_only = local_only
        self._rank = 0
        self._save_id: str | None = None
        self.last_stats: SaveStats | None = None
        #: the coordinator's last durable commit (None before one, and on other ranks)
        self.last_commit: DurableBase | None = None
        self._staging = StagingBuffers()
        # local-only: write_data leaves each rank's files in the tier without a descriptor
        # (_local_pending), finish leaves the coordinator's commit bytes (_local_commit)
        self._local_pending: TierSave | None = None
        self._local_commit: LocalCommit | None = None

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
            self._save_id = _layout.new_save_id()
            return [dataclasses.replace(p, storage_data=_SavePrefix(self._save_id, i))
                    for i, p in enumerate(plans)]
        backend = self._backend()

        backend.run(backend.check_bucket)
        found = None if self.overwrite else completeness(backend)  # the one definition
        self._replaces = found.version if found is not None else None  # a damaged .metadata
        if found is not None and found.complete:
            raise errors.CheckpointExistsError(
                f"Checkpoint already exists: a complete checkpoint exists at "
                f"{redact_url(self._url)}: pick a new path, "
                "or pass VolumeWriter(..., overwrite=True) to replace it"
            )
        save_id = _layout.new_save_id()
        # gc leaves a save alone while its live record is fresh, even before its first object
        backend.run(lambda: _commit.mark_live(backend, save_id))
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
        mine = _SavePrefix(shard_id, prefix.rank)
        if self.local_only:
            results = self._write_local_only(plan.items, planner, mine)
        else:
            results = self._write_live(plan.items, planner, mine, plan_save_id=prefix.save_id)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_live(self, items: list[WriteItem], planner: SavePlanner,
                    prefix: _SavePrefix, *, plan_save_id: str) -> list[WriteResult]:
        """:meth:`_write_rank`, keeping the live record of the id in this rank's shard names
        fresh meanwhile (so gc leaves those objects alone). A rank that fails removes the
        record: DCP commits a save only if every rank succeeded, so what this save wrote is
        garbage now. A rank-local id's record (a cached plan, see ``claim_shard_id``) is
        also removed on success: the coordinator removes only the save id's."""
        backend = self._backend()
        heartbeat = _commit.Heartbeat(backend, prefix.save_id).start()
        try:
            results = self._write_rank(items, planner, prefix)
        except BaseException:
            heartbeat.stop()
            with contextlib.suppress(Exception):  # best effort: gc collects a stale record
                backend.run(lambda: _commit.end_live(backend, prefix.save_id))
            raise
        finally:
            heartbeat.stop()
        if prefix.save_id != plan_save_id and heartbeat.beats:
            with contextlib.suppress(Exception):
                backend.run(lambda: _commit.end_live(backend, prefix.save_id))
        return results

    def _spool_directory(self, items: list[WriteItem]) -> str:
        """The spool directory, cleared of dead spools and with room for ``items``."""
        directory = self.spool.resolved_directory()
        if self.spool.mode == "disk":
            remove_dead_spools(directory)
            check_free_space(directory, sum(map(item_nbytes, items)) + (1 << 20),
                             self.spool.free_space_margin)
        return directory

    def _shard_path(self, prefix: _SavePrefix) -> functools.partial[str]:
        return functools.partial(_shard_path, self.transfer.key_layout, prefix)

    def _write_rank(self, items: list[WriteItem], planner: SavePlanner,
                    prefix: _SavePrefix) -> list[WriteResult]:
        """Spool this rank's items and upload them as they fill; keep them in the local
        tier after, when one is configured."""
        spool, transfer = self.spool, self.transfer
        stats = CallStats()
        start = time.monotonic()
        directory = self._spool_directory(items)
        uploader = Uploader(self._backend(), part_size=transfer.part_size,
                            max_concurrency=transfer.max_concurrency, stats=stats,
                            adaptive=transfer.adaptive_concurrency)
        slots = (threading.Semaphore(transfer.max_concurrency + 1)
                 if spool.mode == "memory" else None)
        # Spool files read once and deleted skip the page cache; kept ones use it (a restart
        # from the local tier then reads them from memory).
        direct = spool.direct_io if spool.direct_io is not None else self.local_tier is None

        def open_file(relative: str, expected: int) -> tuple[SpoolFile, Any]:
            upload = uploader.start_file(
                relative,
                functools.partial(SpoolFile, relative, mode=spool.mode, directory=directory,
                                  part_size=transfer.part_size, buffer_slots=slots,
                                  should_stop=uploader.raise_if_failed, direct=direct),
                expected_size=expected)
            return upload.spool, upload.finish

        out = ShardFiles()
        kept = 0
        spool_end = start
        try:
            spool_items(out, items, planner, files=spool.files_per_rank,
                        shard_path=self._shard_path(prefix), open_file=open_file)
            spool_end = time.monotonic()
            uploader.spooling_ended()
            uploader.wait()
            if self.local_tier is not None:
                kept = self._keep_local(self.local_tier, out.spools, prefix)
        except BaseException:
            uploader.abort()
            raise
        finally:
            self._discard(out.spools, items, planner)
        end = time.monotonic()
        self.last_stats = SaveStats(
            rank=self._rank, bytes=out.nbytes, files=len(out.spools),
            parts=sum(s.parts for s in out.spools), spool_s=spool_end - start,
            upload_s=end - start, upload_tail_s=end - spool_end, retries=stats.retries,
            requests=stats.requests, concurrency=tuple(uploader.limit.history),
            bytes_kept_local=kept,
        )
        s = self.last_stats
        logger.info(
            "rank %d wrote %d bytes in %d files (%d parts) to %s: spool %.2fs, upload %.2fs "
            "(%.2fs after spool), %.1f MiB/s, %d retries, parts in flight %s",
            s.rank, s.bytes, s.files, s.parts, redact_url(self._url), s.spool_s, s.upload_s,
            s.upload_tail_s, s.mib_per_s, s.retries, "->".join(map(str, s.concurrency)),
        )
        return out.results

    def _discard(self, spools: list[SpoolFile], items: list[WriteItem],
                 planner: SavePlanner) -> None:
        """Remove every spool file (one that fails to go does not keep the others), then
        release the staged buffers the items were read from."""
        try:
            for sf in spools:
                try:
                    sf.discard()
                except Exception as exc:  # noqa: BLE001 -- the other spools must go too
                    logger.warning("rank %d: removing the spool file of %s failed (%s)",
                                   self._rank, sf.name, type(exc).__name__)
        finally:
            self._staging.finished_reading(items, planner)

    def _write_local_only(self, items: list[WriteItem], planner: SavePlanner,
                          prefix: _SavePrefix) -> list[WriteResult]:
        """Spool this rank's items and move the files into the local tier (made durable on
        local disk); the descriptor is written by :meth:`complete_local_only`, last."""
        assert self.local_tier is not None
        start = time.monotonic()
        directory = self._spool_directory(items)
        tier = TierSave(self.local_tier, self._url, prefix.save_id, self._rank)
        self._local_pending = None

        def open_file(relative: str, expected: int) -> tuple[SpoolFile, Any]:
            sf = SpoolFile(relative, mode="disk", directory=directory,
                           part_size=self.transfer.part_size, emit=_no_upload)
            return sf, _nothing

        out = ShardFiles()
        try:
            spool_items(out, items, planner, files=self.spool.files_per_rank,
                        shard_path=self._shard_path(prefix), open_file=open_file)
            spool_end = time.monotonic()
            if not tier.admit(out.nbytes):
                raise errors.SpoolError(
                    f"rank {self._rank}: a local-only save of {out.nbytes} bytes exceeds "
                    "LocalTierOptions.max_bytes: raise it, or save to the store")
            for sf in out.spools:
                if sf.path is not None:
                    tier.keep(sf.path, sf.name, sf.tell(), sync=True)
            if not tier.ok:
                raise errors.SpoolError(
                    f"rank {self._rank}: the local-only save could not be written to the "
                    f"local tier {tier.root} (see the warning above)")
        except BaseException:
            tier.abandon()
            raise
        finally:
            self._discard(out.spools, items, planner)
        self._local_pending = tier
        end = time.monotonic()
        self.last_stats = SaveStats(rank=self._rank, bytes=out.nbytes, files=len(out.spools),
                                    spool_s=spool_end - start, upload_s=end - start,
                                    upload_tail_s=end - spool_end, bytes_kept_local=out.nbytes)
        logger.info("rank %d wrote %d bytes in %d files to the local tier for a local-only "
                    "save of %s: %.2fs", self._rank, out.nbytes, len(out.spools),
                    redact_url(self._url), end - start)
        return out.results

    def take_local_commit(self) -> LocalCommit | None:
        """The coordinator's ``.metadata`` and manifest of the local-only save that just
        finished (None on other ranks, or before :meth:`finish`); handed out once."""
        commit, self._local_commit = self._local_commit, None
        return commit

    def complete_local_only(self, commit: LocalCommit | None) -> bool:
        """Finish this rank's part of a local-only save: the coordinator's ``.metadata``
        and manifest bytes (``commit``, the same on every rank), then the descriptor.
        Returns whether this rank's copy is complete (a failure is a WARNING)."""
        tier, self._local_pending = self._local_pending, None
        if tier is None or commit is None:
            if tier is not None:
                tier.abandon()
            return False
        try:
            world = Manifest.from_json(commit.manifest, where="local-only manifest").world_size
        except errors.DCPVolumesError:
            tier.abandon()
            return False
        tier.complete(commit, world)
        return tier.ok

    def _keep_local(self, options: LocalTierOptions, spools: list[SpoolFile],
                    prefix: _SavePrefix) -> int:
        """Move this rank's uploaded spool files into the local tier; the bytes kept. Never
        raises (an Exception): the save is durable in the store whatever happens here."""
        tier = TierSave(options, self._url, prefix.save_id, self._rank)
        try:
            if not tier.admit(sum(sf.tell() for sf in spools)):
                return 0
            for sf in spools:
                if sf.path is not None:
                    tier.keep(sf.path, sf.name, sf.tell())
            return tier.complete()
        except Exception as exc:  # noqa: BLE001 — a local copy is optional, the save is not
            logger.warning("rank %d: keeping the save in the local tier failed (%s)",
                           self._rank, type(exc).__name__)
            tier.abandon()
            return 0

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._save_id is None:
            raise errors.DCPVolumesError("finish() called without prepare_global_plan()")
        save_id = self._save_id
        start = time.monotonic()
        with paused_gc():  # a million items: see paused_gc
            manifest = manifest_of(save_id, f"dcp_volumes {__version__}", results)
            metadata.storage_data = {wr.index: _plain_storage_info(wr.storage_data)
                                     for rank_results in results for wr in rank_results}
            set_save_id(metadata, save_id, self._url)
            metadata_bytes = pickle.dumps(metadata)
        if self.local_only:
            # completed on every rank by the Checkpointer, which broadcasts these bytes
            self._local_commit = LocalCommit(save_id, metadata_bytes, manifest.to_json())
            return
        backend = self._backend()
        stats = CallStats()
        try:
            try:
                # Never commit a save with a missing object: with overwrite that would replace
                # a loadable checkpoint by one that cannot load.
                backend.run(lambda: _commit.check_durable(backend, manifest))
            except errors.UploadError:
                backend.run(lambda: _commit.remove_quietly(backend, sorted(manifest.files)))
                raise
            superseded = backend.run(lambda: _commit.commit(
                backend, manifest=manifest, metadata_bytes=metadata_bytes,
                overwrite=self.overwrite, stats=stats, replaces=self._replaces))
        finally:
            with contextlib.suppress(Exception):  # best effort: gc collects a stale record
                backend.run(lambda: _commit.end_live(backend, save_id))
        commit_s = time.monotonic() - start
        self.last_commit = DurableBase(normal_url(self._url), save_id, manifest.sha256)
        _commit.remove_superseded(backend, superseded)
        prev = self.last_stats or SaveStats(rank=self._rank)
        self.last_stats = dataclasses.replace(prev, commit_s=commit_s,
                                              retries=prev.retries + stats.retries)
        logger.info("committed %s (save %s, %d files) in %.2fs", redact_url(self._url),
                    save_id, len(manifest.files), commit_s)


def _no_upload(part: Any) -> None:
    """A local-only save's spool files are not uploaded: their parts go nowhere."""


_nothing = functools.partial(_no_upload, None)  # a local-only file needs nothing once full


def _shard_path(key_layout: str, prefix: _SavePrefix, index: int) -> str:
    return _layout.shard_path(key_layout, prefix.rank, index, prefix.save_id)


def _plain_storage_info(info: Any) -> _StorageInfo:
    """What ``.metadata`` records for an item: a plain ``_StorageInfo`` (reused as is when it
    is one: a million items at rank 0 make the copy cost a second)."""
    if type(info) is _StorageInfo:
        return info
    return _StorageInfo(info.relative_path, info.offset, info.length)
