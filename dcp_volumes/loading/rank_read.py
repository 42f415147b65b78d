"""One rank's ``read_data``: its needs from the nearest source that serves them.

Its local tier first (:func:`~dcp_volumes.loading.direct.read_tier`), then the cooperative
exchange for the bytes several ranks need (:class:`~dcp_volumes.loading.cooperative.
CooperativeRead`), then the store, the last source (:func:`~dcp_volumes.loading.direct.
read_store`); a local-only save has no store copy, so a need left to the store fails the
load. The figures of the rank's read come back as its :class:`~dcp_volumes.stats.LoadStats`.
``VolumeReader`` builds a :class:`RankRead` from what its lifecycle learned and runs it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from dcp_volumes import errors, tier
from dcp_volumes._manifest import Manifest
from dcp_volumes.backends import Backend, CallStats
from dcp_volumes.backends.versions import ObjectVersion
from dcp_volumes.config import TransferOptions
from dcp_volumes.loading import cooperative
from dcp_volumes.loading.apply import PlannerTarget
from dcp_volumes.loading.direct import TierRead, read_store, read_tier
from dcp_volumes.loading.needs import Need, plan_needs
from dcp_volumes.loading.sources import LocalTierSource, StoreSource
from dcp_volumes.stats import LoadStats

__all__ = ["RankRead"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Tiered(TierRead):
    """This rank's needs, and what its local tier did with them."""

    needs: list[Need] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RankRead:
    """What one rank's read needs to know: the checkpoint as opened and set up, the reader's
    options, and this rank's local tier files (``url`` is already redacted)."""

    url: str
    backend: Callable[[], Backend]
    transfer: TransferOptions
    storage_data: dict[Any, Any]
    manifest: Manifest | None
    metadata: Metadata | None
    extension_registry: Any
    trusted: tuple[Any, ...]
    timeout_s: float
    local: dict[str, tier.LocalFile]
    local_rejected: dict[str, str]
    #: a local-only save: no store copy to fall back on
    local_only: bool
    pins: Mapping[str, ObjectVersion] | None
    verified: bool
    rank: int
    metadata_retries: int

    def run(self, plan: LoadPlan, planner: LoadPlanner) -> LoadStats:
        """This rank's needs: from its local tier first, then from the peers (cooperative:
        the bytes several ranks need) or the store."""
        url = self.url
        start = time.monotonic()
        target = PlannerTarget(planner, self.trusted)
        coop = plan.storage_data if isinstance(plan.storage_data, cooperative.Assignment) \
            else None
        if coop is None:
            tiered = self._read_tier(plan, target, cooperative=False)
            figures = None
        else:
            tiered, figures = self._read_cooperative(plan, planner, coop, target)
        store_needs = tiered.fallback if figures is not None else \
            tiered.fallback + tiered.elsewhere
        self._only_local(store_needs)
        store = self._store() if store_needs else None
        nranges = read_store(store_needs, store, target, gap=self.transfer.coalesce_gap,
                             max_size=self.transfer.max_range_size, url=url) if store else 0
        fig = figures or cooperative.ExchangeFigures()
        return LoadStats(
            rank=self.rank, bytes_needed=sum(n.needed for n in tiered.needs),
            bytes_fetched=fig.bytes_fetched + (store.fetched if store else 0),
            items=len(tiered.needs), ranges=fig.ranges + nranges,
            fetch_s=time.monotonic() - start, verified=self.verified,
            retries=(fig.calls.retries + (store.stats.retries if store else 0)
                     + self.metadata_retries),
            cooperative=figures is not None, bytes_from_peers=fig.bytes_from_peers,
            bytes_to_peers=fig.bytes_to_peers, rounds=fig.rounds, peer_wait_s=fig.wait_s,
            bytes_from_local=tiered.bytes_used + fig.bytes_from_local,
            local_fallbacks=self._fallbacks(tiered) + fig.local_fallbacks,
        )

    @property
    def sizes(self) -> dict[str, int] | None:
        """The shard files' sizes the checked manifest holds (no HEAD per file and rank)."""
        if self.manifest is None:
            return None
        return {name: entry.size for name, entry in self.manifest.files.items()}

    def _store(self) -> StoreSource:
        return StoreSource(self.backend(), self.url,
                           max_concurrency=self.transfer.max_concurrency,
                           chunk_size=self.transfer.part_size, stats=CallStats(),
                           pins=self.pins, sizes=self.sizes)

    def _read_tier(self, plan: LoadPlan, target: PlannerTarget, *, cooperative: bool) -> Tiered:
        """This rank's needs, applied from the local tier first. What the store must serve
        after (and, without ``cooperative``, what the tier does not hold) is checked here
        against a local-only save, which has no store copy."""
        url = self.url
        needs = plan_needs(plan.items, self.storage_data, self.manifest, url,
                           self.metadata, self.extension_registry)
        for relative in sorted({n.relative for n in needs} & set(self.local_rejected)):
            logger.warning("local copy of shard %s of %s is not used: %s; reading it from "
                           "the store", relative, url, self.local_rejected[relative])
        read = read_tier(needs, LocalTierSource(self.local, url), target,
                         gap=self.transfer.coalesce_gap, max_size=self.transfer.max_range_size,
                         url=url)
        tiered = Tiered(read.bytes_used, read.fallback, read.elsewhere, needs)
        self._only_local(tiered.fallback + ([] if cooperative else tiered.elsewhere))
        return tiered

    def _only_local(self, to_store: list[Need]) -> None:
        """A local-only save has no store copy: a need left to the store fails the load."""
        if self.local_only and to_store:
            raise errors.IntegrityError(
                f"rank {self.rank}: shard {to_store[0].relative} of the local-only save of "
                f"{self.url} has no usable local copy on this node (and no rank serves it), "
                "and the store has none: load the newest durable checkpoint instead")

    def _read_cooperative(self, plan: LoadPlan, planner: LoadPlanner,
                          assignment: cooperative.Assignment, target: PlannerTarget
                          ) -> tuple[Tiered, cooperative.ExchangeFigures | None]:
        """This rank's part of a cooperative load, after its local tier's: what the tier
        did, and the exchange's figures (None when the ranks agreed to read directly)."""
        coop = cooperative.CooperativeRead(
            assignment, url=self.url, planner=planner, trusted=self.trusted,
            max_concurrency=self.transfer.max_concurrency,
            part_size=self.transfer.part_size, max_range_size=self.transfer.max_range_size,
            timeout_s=self.timeout_s, local_files=self.local,
            store=not self.local_only, sizes=self.sizes, pins=self.pins,
        )
        tiered, backend, failed = Tiered(), None, None
        try:
            backend = self.backend()
            tiered = self._read_tier(plan, target, cooperative=True)
        except Exception as exc:  # noqa: BLE001 — coop.run reports it to every rank at once
            failed = exc
        return tiered, coop.run(backend, tiered.elsewhere, failed=failed)

    def _fallbacks(self, tiered: Tiered) -> int:
        rejected = sum(1 for n in tiered.needs if n.relative in self.local_rejected)
        return rejected + len(tiered.fallback)
