"""A rank's durable save: its shard files spooled and streamed to the store as they fill,
then kept in the local tier when one is configured.

The rank's thread serializes each file into a :class:`~dcp_volumes.saving._spool.SpoolFile`;
the :class:`~dcp_volumes.saving._upload.Uploader` takes the file's parts from its stream on
the backend's event loop. Neither calls the other: the stream is the only seam.
"""

from __future__ import annotations

import logging
import threading
import time

from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes.backends import Backend, CallStats, redact_url
from dcp_volumes.saving._rank import RankJob, discard_spools
from dcp_volumes.saving._shards import ShardFiles, serializing
from dcp_volumes.saving._spool import SpoolFile
from dcp_volumes.saving._upload import Uploader
from dcp_volumes.stats import SaveStats
from dcp_volumes.tier import TierSave

__all__ = ["write_to_store"]

logger = logging.getLogger(__name__)


def write_to_store(job: RankJob, backend: Backend) -> tuple[list[WriteResult], SaveStats]:
    """Spool ``job``'s items and upload them as they fill; keep them in the local tier
    after, when one is configured. Returns the write results and the rank's figures."""
    transfer = job.transfer
    calls = CallStats()
    start = time.monotonic()
    directory = job.spool_directory()
    uploader = Uploader(backend, part_size=transfer.part_size,
                        max_concurrency=transfer.max_concurrency, stats=calls,
                        adaptive=transfer.adaptive_concurrency)
    out = ShardFiles()
    kept = 0
    spool_end = start
    try:
        _spool_and_upload(job, uploader, directory, out)
        spool_end = time.monotonic()
        uploader.wait()
        if job.local_tier is not None:
            kept = _keep_local(job, out.spools)
    except BaseException:
        uploader.abort()
        raise
    finally:
        discard_spools(out.spools, job.rank)
    end = time.monotonic()
    stats = SaveStats(
        rank=job.rank, bytes=out.nbytes, files=len(out.spools),
        parts=sum(s.parts_handed_out for s in out.spools), spool_s=spool_end - start,
        upload_s=end - start, upload_tail_s=end - spool_end, retries=calls.retries,
        requests=calls.requests, concurrency=tuple(uploader.limit.history),
        bytes_kept_local=kept,
    )
    logger.info(
        "rank %d wrote %d bytes in %d files (%d parts) to %s: spool %.2fs, upload %.2fs "
        "(%.2fs after spool), %.1f MiB/s, %d retries, parts in flight %s",
        stats.rank, stats.bytes, stats.files, stats.parts, redact_url(job.url), stats.spool_s,
        stats.upload_s, stats.upload_tail_s, stats.mib_per_s, stats.retries,
        "->".join(map(str, stats.concurrency)),
    )
    return out.results, stats


def _spool_and_upload(job: RankJob, uploader: Uploader, directory: str,
                      out: ShardFiles) -> None:
    """Serialize each shard file while the uploader streams its parts to the store."""
    spool, transfer = job.spool, job.transfer
    # memory mode: the part buffers alive at once (in flight, and one being filled)
    slots = (threading.Semaphore(transfer.max_concurrency + 1)
             if spool.mode == "memory" else None)
    # Spool files read once and deleted skip the page cache; kept ones use it (a restart
    # from the local tier then reads them from memory).
    direct = spool.direct_io if spool.direct_io is not None else job.local_tier is None
    with serializing():
        for shard in job.shards():
            sf = out.track(SpoolFile(shard.relative, mode=spool.mode, directory=directory,
                                     part_size=transfer.part_size, buffer_slots=slots,
                                     direct=direct))
            uploader.upload(shard.relative, sf.parts, expected_size=shard.nbytes)
            out.fill(sf, shard, job.planner)


def _keep_local(job: RankJob, spools: list[SpoolFile]) -> int:
    """Move this rank's uploaded spool files into the local tier; the bytes kept. Never
    raises (an Exception): the save is durable in the store whatever happens here."""
    assert job.local_tier is not None
    tier = TierSave(job.local_tier, job.url, job.shard_id, job.rank)
    try:
        if not tier.admit(sum(sf.tell() for sf in spools)):
            return 0
        for sf in spools:
            if sf.path is not None:
                tier.keep(sf.path, sf.name, sf.tell())
        return tier.complete()
    except Exception as exc:  # noqa: BLE001 — a local copy is optional, the save is not
        logger.warning("rank %d: keeping the save in the local tier failed (%s)",
                       job.rank, type(exc).__name__)
        tier.abandon()
        return 0
