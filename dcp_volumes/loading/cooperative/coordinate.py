"""The coordinator's step of a cooperative load (DCP's ``prepare_global_plan``).

From every rank's plan it works out the stored bytes each rank needs beyond its own local
tier, asks the pure planner (:func:`~dcp_volumes.loading.cooperative.assign.assign`) whether
and how to share them, and returns the plans with one ``Assignment`` each, or unchanged
(every rank reads directly) with the reason in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from dcp_volumes import errors
from dcp_volumes._manifest import Manifest
from dcp_volumes.config import TransferOptions
from dcp_volumes.loading.cooperative.assign import assign
from dcp_volumes.loading.needs import Need, plan_needs

__all__ = ["coordinate", "from_store"]

logger = logging.getLogger(__name__)


def coordinate(plans: list[LoadPlan], *, mode: bool | Literal["auto"],
               storage_data: dict[Any, Any], manifest: Manifest | None,
               metadata: Metadata | None, extension_registry: Any,
               transfer: TransferOptions, url: str) -> list[LoadPlan]:
    """The plans of a cooperative load when the ranks share bytes, else ``plans``
    (``mode``: the reader's ``cooperative=``, not False; ``url`` already redacted)."""
    try:
        # a rank reads what it needs of its local files itself (left out here), and
        # serves those files to the ranks that need them
        needs = [from_store(plan_needs(p.items, storage_data, manifest, url, metadata,
                                       extension_registry),
                            getattr(p.storage_data, "local_files", frozenset()))
                 for p in plans]
    except errors.DCPVolumesError as exc:
        # the rank concerned raises it in read_data, with its own reads at hand
        logger.debug("no cooperative load of %s: %s", url, exc)
        return plans
    assigned, why = assign(needs, [p.storage_data for p in plans],
                           unit_bytes=transfer.part_size, gap=transfer.coalesce_gap)
    if assigned is None or isinstance(why, str):
        log = logger.warning if mode is True and len(plans) > 1 else logger.debug
        log("%s: every rank reads directly: %s", url, why)
        return plans
    logger.info("cooperative load of %s on %d ranks: %d unique bytes (%d shared, %d read "
                "from local tiers) read once instead of %d, in %d bundles and %d rounds",
                url, why.ranks, why.unique_bytes, why.shared_bytes, why.local_bytes,
                why.direct_bytes, why.bundles, why.rounds)
    return [dataclasses.replace(p, storage_data=a) for p, a in zip(plans, assigned)]


def from_store(needs: list[Need], local_files: frozenset[str]) -> list[Need]:
    """The needs not served by the rank's local tier (the files it found there)."""
    if not local_files:
        return needs
    return [n for n in needs if n.relative not in local_files]
