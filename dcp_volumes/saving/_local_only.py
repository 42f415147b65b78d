"""A rank's local-only save: its shard files written to its local tier and nowhere else
(:func:`write_local_only`), and the save completed on every rank once the coordinator's
commit bytes exist (:func:`complete_local_only`).

``dcp.save`` hands the ``.metadata`` and manifest to the coordinator only (in ``finish``),
and every rank's tier needs them: the completion is one collective after ``dcp.save``
returned, which sends them from the coordinator to every rank; each rank then writes them
and its descriptor, last (see :class:`~dcp_volumes.tier.TierSave`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes import errors
from dcp_volumes._manifest import Manifest
from dcp_volumes.backends import redact_url
from dcp_volumes.saving._rank import RankJob, discard_spools
from dcp_volumes.saving._shards import ShardFiles, serializing
from dcp_volumes.saving._spool import SpoolFile
from dcp_volumes.stats import SaveStats
from dcp_volumes.tier import DurableBase, LocalCommit, TierSave

__all__ = ["complete_local_only", "write_local_only"]

logger = logging.getLogger(__name__)


def write_local_only(job: RankJob) -> tuple[list[WriteResult], SaveStats, TierSave]:
    """Spool ``job``'s items and move the files into the local tier (made durable on local
    disk). Returns the write results, the rank's figures and its tier save, which
    :func:`complete_local_only` completes (its descriptor is written last)."""
    assert job.local_tier is not None
    start = time.monotonic()
    directory = job.spool_directory()
    tier = TierSave(job.local_tier, job.url, job.shard_id, job.rank)
    out = ShardFiles()
    try:
        with serializing():
            for shard in job.shards():
                # nobody takes the parts: they wait in the stream (records, no bytes)
                sf = out.track(SpoolFile(shard.relative, mode="disk", directory=directory,
                                         part_size=job.transfer.part_size))
                out.fill(sf, shard, job.planner)
        spool_end = time.monotonic()
        _keep(job, tier, out)
    except BaseException:
        tier.abandon()
        raise
    finally:
        discard_spools(out.spools, job.rank)
    end = time.monotonic()
    stats = SaveStats(rank=job.rank, bytes=out.nbytes, files=len(out.spools),
                      spool_s=spool_end - start, upload_s=end - start,
                      upload_tail_s=end - spool_end, bytes_kept_local=out.nbytes)
    logger.info("rank %d wrote %d bytes in %d files to the local tier for a local-only "
                "save of %s: %.2fs", job.rank, out.nbytes, len(out.spools),
                redact_url(job.url), end - start)
    return out.results, stats, tier


def _keep(job: RankJob, tier: TierSave, out: ShardFiles) -> None:
    """Move the spooled files into the tier, fsynced; raise if the tier cannot hold them."""
    if not tier.admit(out.nbytes):
        raise errors.SpoolError(
            f"rank {job.rank}: a local-only save of {out.nbytes} bytes exceeds "
            "LocalTierOptions.max_bytes: raise it, or save to the store")
    for sf in out.spools:
        if sf.path is not None:
            tier.keep(sf.path, sf.name, sf.tell(), sync=True)
    if not tier.ok:
        raise errors.SpoolError(
            f"rank {job.rank}: the local-only save could not be written to the "
            f"local tier {tier.root} (see the warning above)")


def complete_local_only(tier: TierSave | None, commit: LocalCommit | None, *,
                        base: Callable[[], DurableBase | None],
                        group: dist.ProcessGroup | None) -> bool:
    """Complete this rank's copy of a local-only save (a collective over ``group`` when
    torch.distributed is initialized: every rank of the save calls it).

    Args:
        tier: this rank's files of the save (None if it wrote none).
        commit: the coordinator's ``.metadata`` and manifest (None on other ranks).
        base: asked on the coordinator only: the durable checkpoint the save continues,
            recorded with it (see ``docs/guarantees.md``).
        group: the save's process group.

    Returns:
        Whether this rank's copy is complete (a failure is a WARNING in the tier).
    """
    if commit is not None:
        commit = dataclasses.replace(commit, base=base())
    if dist.is_available() and dist.is_initialized():
        box: list[object] = [commit]
        dist.broadcast_object_list(box, group_src=0, group=group)
        commit = box[0] if isinstance(box[0], LocalCommit) else None
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
