"""One cooperative round's bytes on one rank, and the peer as a source.

A rank reads the bundles it owns (local tier, then store: :class:`Held` spans, checked by
their pieces, kept by :class:`Keep`), exchanges them (:mod:`.exchange`), and then serves its
own needs out of the round's bytes — the peer source, :class:`PeerRound` — into the
planner's targets through the one serve path. Bytes from a peer are not checked again: the
rank that read them checked them (``needs_check = False``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dcp_volumes import _dist
from dcp_volumes.loading.apply import DirectTarget
from dcp_volumes.loading.cooperative.storage_data import Bundle, Piece
from dcp_volumes.loading.needs import Need
from dcp_volumes.loading.sources import Payload
from dcp_volumes.transfer.download import RangeRequest

__all__ = ["Held", "Keep", "PeerRound", "RoundBytes"]


@dataclass
class RoundBytes:
    """One round's bytes on one rank."""

    data: dict[int, memoryview] = field(default_factory=dict)  # read bundles (owned)
    received: dict[int, memoryview] = field(default_factory=dict)  # bundles in own buffers
    recv_into: dict[int, torch.Tensor] = field(default_factory=dict)  # where each arrives
    direct: set[int] = field(default_factory=set)  # bundles received into their target
    targets: dict[tuple[str, int], DirectTarget] = field(default_factory=dict)
    need_bufs: dict[tuple[str, int], bytearray] = field(default_factory=dict)


@dataclass(frozen=True)
class Held:
    """A bundle this rank reads (from its local tier or the store) as a span of the serve
    path: checked as its ``parts``, one :class:`~dcp_volumes.loading.needs.Need` per piece."""

    bundle: Bundle
    parts: tuple[Need, ...]

    @property
    def relative(self) -> str:
        return self.bundle.relative

    @property
    def start(self) -> int:
        return self.bundle.start

    @property
    def end(self) -> int:
        return self.bundle.end


def held(b: Bundle, need_of: Mapping[tuple[str, int], Need]) -> Held:
    """``b`` as a span whose pieces are checked with what the rank knows of their items (an
    item the rank serves without needing it is described by the piece alone)."""
    parts = []
    for p in b.pieces:
        need = need_of.get((b.relative, p.item_offset))
        if need is not None:
            parts.append(Need.part(b.relative, p.start, p.end, item_offset=need.item_offset,
                                   item_length=need.item_length, reads=need.reads,
                                   entry=need.entry, first_block=p.first_block))
        else:
            parts.append(Need.part(b.relative, p.start, p.end, item_offset=p.item_offset,
                                   item_length=p.item_length, entry=p.entry,
                                   first_block=p.first_block))
    return Held(b, tuple(parts))


class Keep:
    """The serve path's target for a rank's own bundles: their checked bytes, kept for the
    exchange (``RoundBytes.data``)."""

    def __init__(self, st: RoundBytes) -> None:
        self.st = st

    def apply(self, span: Held, chunk: memoryview, into: object) -> None:
        self.st.data[span.bundle.bid] = chunk


class PeerRound:
    """The peer as a source: each of this rank's needs of a round, out of the round's bytes
    (bundles it read itself, or received from their owners). A need whose bytes map one to
    one onto its target's memory was received there (its own bundles' bytes are copied in
    here): it is served in place (the range's ``into``)."""

    needs_check = False  # checked by the rank that read them

    def __init__(self, st: RoundBytes, parts: Mapping[tuple[str, int], list[tuple[Piece, Bundle]]],
                 me: int) -> None:
        self.st = st
        self.parts = parts
        self.me = me

    def ranges(self, needs: Sequence[Need]) -> list[RangeRequest]:
        """One range per need, in order."""
        return [RangeRequest(n.relative, n.start, n.end, [n],
                             into=self.st.targets.get((n.relative, n.item_offset)))
                for n in needs]

    def serve(self, ranges: Sequence[RangeRequest], stop: threading.Event | None = None
              ) -> Iterator[tuple[RangeRequest, Payload]]:
        for rng in ranges:
            need = rng.items[0]
            key = (need.relative, need.item_offset)
            if isinstance(rng.into, DirectTarget):  # the only memory ranges() hands out
                self._fill(key, rng.into)
                yield rng, rng.into.bytes_view()
            else:
                yield rng, self._bytes(key, need)

    def _own(self, b: Bundle) -> memoryview:
        return self.st.data[b.bid] if b.owner == self.me else self.st.received[b.bid]

    def _fill(self, key: tuple[str, int], target: DirectTarget) -> None:
        """Copy into ``target`` the bytes of its pieces that were not received there."""
        for p, b in self.parts[key]:
            if b.bid in self.st.direct:
                continue  # received in place
            lo, hi = max(p.start, target.start), min(p.end, target.end)
            if lo < hi:
                target.view[lo - target.start:hi - target.start].copy_(
                    _dist.uint8_tensor(self._own(b)[lo - b.start:hi - b.start]))

    def _bytes(self, key: tuple[str, int], need: Need) -> memoryview:
        """The need's bytes: one piece's, or its pieces assembled in its buffer."""
        parts = self.parts[key]
        if key in self.st.need_bufs:
            buf = self.st.need_bufs[key]
            for p, b in parts:
                if b.owner == self.me:
                    buf[p.start - need.start:p.end - need.start] = \
                        self.st.data[b.bid][p.start - b.start:p.end - b.start]
            return memoryview(buf)
        p, b = parts[0]
        return self._own(b)[p.start - b.start:p.end - b.start]
