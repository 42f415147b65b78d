"""One rank's part of one save (:class:`RankJob`): its items, the names of its shard
files, its options; and removing its spool files when it ends."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from dcp_volumes import _layout
from dcp_volumes.config import LocalTierOptions, SpoolOptions, TransferOptions
from dcp_volumes.saving._shards import Shard, item_nbytes, plan_shards
from dcp_volumes.saving._spool import SpoolFile
from dcp_volumes.saving._spool_dir import spool_directory

__all__ = ["RankJob", "discard_spools"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankJob:
    """What one rank writes in one save, and how.

    Attributes:
        items, planner: the rank's write items and the planner that resolves them.
        url: the checkpoint's URL.
        rank: this rank (its figures, logs and local tier files carry it).
        index: the rank's index in the save's plan (its shard names carry it).
        shard_id: the save id its shard names carry (see ``claim_shard_id``).
        spool, transfer: the writer's options.
        local_tier: the local tier, if the writer has one.
    """

    items: list[WriteItem]
    planner: SavePlanner
    url: str
    rank: int
    index: int
    shard_id: str
    spool: SpoolOptions
    transfer: TransferOptions
    local_tier: LocalTierOptions | None = None

    def shards(self) -> list[Shard]:
        """The rank's shard files and what each holds."""
        return plan_shards(self.items, files=self.spool.files_per_rank,
                           shard_path=self._shard_path)

    def _shard_path(self, index: int) -> str:
        return _layout.shard_path(self.transfer.key_layout, self.index, index, self.shard_id)

    def spool_directory(self) -> str:
        """The spool directory, cleared of dead spools and with room for the items."""
        return spool_directory(self.spool, sum(map(item_nbytes, self.items)))


def discard_spools(spools: list[SpoolFile], rank: int) -> None:
    """Remove every spool file; one that fails to go does not keep the others."""
    for sf in spools:
        try:
            sf.discard()
        except Exception as exc:  # noqa: BLE001 -- the other spools must go too
            logger.warning("rank %d: removing the spool file of %s failed (%s)", rank,
                           sf.name, type(exc).__name__)
