"""What a rank writes in a save, as a stream: shard files serialized into the spool, their
parts streamed to the store, the files kept in (or, local-only, written to) the local tier.

(Named ``saving``, not ``save``: ``dcp_volumes.save`` is the public save function.)

Modules, each with one job:

- ``_rank``: one rank's part of one save (:class:`RankJob`): items, shard names, options.
- ``_durable``: a durable save: spool and upload each file, keep it in the local tier.
- ``_local_only``: a local-only save: spool into the local tier; its completion on every
  rank (one collective after ``dcp.save``).
- ``_shards``: split items into files by size, serialize an item as torch does, shard ids.
- ``_spool``: :class:`SpoolFile`, what ``torch.save`` writes into; it puts each complete
  part into its :class:`PartStream` (``_parts``) and knows nothing of who takes them.
- ``_checksums``: CRC32C per item, part and block, one read per byte.
- ``_spool_disk`` / ``_spool_direct``: the file behind a disk spool, ``O_DIRECT`` where
  the filesystem takes it.
- ``_spool_dir``: spool file names, free space, dead spools.
- ``_upload``: :class:`Uploader`, which takes each file's parts from its stream on the
  backend's event loop and hands them to the store's sink, a few in flight.
- ``_staging``: the process's pool of CPU staging buffers for ``dcp.async_save``.

The export (:mod:`dcp_volumes.export`) streams its files through the same
:class:`SpoolFile` (memory mode) and :class:`Uploader`.
"""

from __future__ import annotations

from dcp_volumes.saving._commit_bytes import commit_bytes
from dcp_volumes.saving._durable import write_to_store
from dcp_volumes.saving._local_only import complete_local_only, write_local_only
from dcp_volumes.saving._parts import PartStream, SpooledPart
from dcp_volumes.saving._rank import RankJob
from dcp_volumes.saving._shards import claim_shard_id
from dcp_volumes.saving._spool import SpoolFile
from dcp_volumes.saving._staging import StagingBuffers, release_staging_buffers
from dcp_volumes.saving._store import begin_store_save, commit_store_save
from dcp_volumes.saving._upload import Uploader

#: the save stream (export and integrations) and the writer's steps (writer.py)
__all__ = ["PartStream", "RankJob", "SpoolFile", "SpooledPart", "StagingBuffers", "Uploader",
           "begin_store_save", "claim_shard_id", "commit_bytes", "commit_store_save",
           "complete_local_only", "release_staging_buffers", "write_local_only",
           "write_to_store"]
