"""Figures a writer or reader keeps about its last call (for logs and benchmarks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LoadStats", "SaveStats"]


class _Figures:
    """Shared by the two figure sets: throughput over the main byte count and phase."""

    def _rate(self, nbytes: int, seconds: float) -> float:
        return nbytes / 2**20 / seconds if seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mib_per_s": round(self.mib_per_s, 2)}  # type: ignore[call-overload]

    @property
    def mib_per_s(self) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class SaveStats(_Figures):
    """One rank's view of one save.

    Attributes:
        rank: the rank these figures are from.
        bytes: payload bytes this rank wrote.
        files: shard files this rank wrote.
        parts: parts (multipart parts / blocks / chunks) uploaded.
        spool_s: seconds serializing into the spool (uploads overlap this).
        upload_s: seconds from the start of ``write_data`` until every byte was durable.
        upload_tail_s: part of ``upload_s`` spent waiting after serialization ended.
        commit_s: seconds to write the manifest and ``.metadata`` (coordinator only, else 0).
        retries: transient failures retried.
        requests: requests made to the store.
        concurrency: the limit on parts in flight, each level it took in order (the last
            one is where it settled; see ``TransferOptions.adaptive_concurrency``).
        bytes_kept_local: bytes this rank kept in the local tier (``local_tier=``; 0 when
            none is configured or keeping failed).
    """

    rank: int = 0
    bytes: int = 0
    files: int = 0
    parts: int = 0
    spool_s: float = 0.0
    upload_s: float = 0.0
    upload_tail_s: float = 0.0
    commit_s: float = 0.0
    retries: int = 0
    requests: int = 0
    concurrency: tuple[int, ...] = ()
    bytes_kept_local: int = 0

    @property
    def mib_per_s(self) -> float:
        return self._rate(self.bytes, self.upload_s)


@dataclass(frozen=True)
class LoadStats(_Figures):
    """One rank's view of one load.

    Attributes:
        rank: the rank these figures are from.
        bytes_needed: bytes of the stored items this rank's plan needed.
        bytes_fetched: bytes this rank fetched from the store (coalesced ranges include
            small gaps; in a cooperative load, the ranges it fetched for every rank).
        items: stored items read.
        ranges: ranged GETs planned (a range longer than a part is fetched in parts).
        fetch_s: seconds from the first GET to the last item copied into place.
        verified: whether checksums were verified (False for checkpoints without a manifest).
        retries: transient failures retried.
        cooperative: whether the ranks loaded cooperatively (``VolumeReader(cooperative=)``):
            each shared byte range fetched once, by one rank, and sent to the others.
        bytes_from_peers: bytes received from other ranks instead of the store.
        bytes_to_peers: bytes sent to other ranks (each consumer counted).
        rounds: exchange rounds of a cooperative load (memory is bounded per round).
        peer_wait_s: part of ``fetch_s`` spent waiting on other ranks: their status reports
            and the exchange.
        bytes_from_local: bytes of stored items read from this node's local tier
            (``local_tier=``) and verified; not counted in ``bytes_fetched``.
        local_fallbacks: items the local tier held a copy of that could not be used (a
            missing, wrong-size or linked file, or bytes failing their checksum) and were
            read from the store instead.
    """

    rank: int = 0
    bytes_needed: int = 0
    bytes_fetched: int = 0
    items: int = 0
    ranges: int = 0
    fetch_s: float = 0.0
    verified: bool = False
    retries: int = 0
    cooperative: bool = False
    bytes_from_peers: int = 0
    bytes_to_peers: int = 0
    rounds: int = 0
    peer_wait_s: float = 0.0
    bytes_from_local: int = 0
    local_fallbacks: int = 0

    @property
    def mib_per_s(self) -> float:
        return self._rate(self.bytes_fetched, self.fetch_s)
