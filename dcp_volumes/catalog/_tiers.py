"""What one node's local tier holds of a run: local copies of durable checkpoints, and
local-only saves (never in the store). ``dcp-volumes ls --local-tier DIR`` shows both next
to the store's listing.

The tier's layout is :mod:`dcp_volumes.tier`'s; everything in it is untrusted, so a
local-only save counts only when :func:`dcp_volumes.tier.find_local_only` accepts it (its
descriptor, ``.metadata`` and manifest checked, its files present at their sizes).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dcp_volumes.catalog._common import compile_step_pattern, step_of
from dcp_volumes.config import LocalTierOptions

__all__ = ["TierCopy", "local_tier_copies"]

if TYPE_CHECKING:
    from dcp_volumes.tier import Descriptor

TierKind = Literal["local-only", "local-copy"]


@dataclass(frozen=True)
class TierCopy:
    """One save of the run found in a node's local tier.

    Attributes:
        name: the checkpoint's directory name under the run root.
        step: the step parsed from ``name``; ``None`` if the step pattern does not match.
        kind: ``"local-only"`` (written to local tiers only: not durable) or ``"local-copy"``
            (the local copy a durable save kept).
        ranks: the ranks whose files this tier holds.
        world: ranks in the save (local-only saves; ``None`` for local copies).
        bytes: bytes of those files.
        files: number of those files.
        created: epoch seconds of the newest rank descriptor.
    """

    name: str
    step: int | None
    kind: TierKind
    ranks: tuple[int, ...]
    world: int | None
    bytes: int
    files: int
    created: float

    @property
    def complete_here(self) -> bool:
        """A local-only save whose every rank's files are in this tier (one node saved it
        all); local copies: always True."""
        return self.world is None or set(self.ranks) == set(range(self.world))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "step": self.step,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "world": self.world,
            "bytes": self.bytes,
            "files": self.files,
            "created": self.created,
            "complete_here": self.complete_here,
        }


def local_tier_copies(
    root: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    step_pattern: str | re.Pattern[str] | None = None,
) -> list[TierCopy]:
    """The saves of the run under ``root`` in the local tier ``directory``, by step.

    Args:
        root: the run root, as the Checkpointer was given it (credentials are ignored).
        directory: the ``LocalTierOptions.directory`` of this node.
        step_pattern: as for :func:`~dcp_volumes.catalog.list_checkpoints`.
    """
    # here, not at the top: checking a local-only save's .metadata imports torch, and
    # `import dcp_volumes.catalog` (ls --check 0) must not
    from dcp_volumes import tier

    pattern = compile_step_pattern(step_pattern)
    options = LocalTierOptions(directory=os.fspath(directory), keep_last=None)
    valid = {
        (c.url, c.save_id, c.rank): c.world
        for c in tier.find_local_only(options, lambda u: tier.name_under(root, u) is not None)
    }
    out = [
        TierCopy(
            name=name,
            step=step_of(name, pattern),
            kind=kind,
            ranks=tuple(sorted(e["ranks"])),
            world=e["world"],
            bytes=e["bytes"],
            files=e["files"],
            created=e["created"],
        )
        for (name, _, kind), e in _by_save(root, options, valid).items()
    ]
    out.sort(key=lambda c: (c.step is None, c.step or 0, c.name, c.created))
    return out


def _by_save(root: str | os.PathLike[str], options: LocalTierOptions,
             valid: dict[tuple[str, str, int], int]
             ) -> dict[tuple[str, str, TierKind], dict[str, Any]]:
    """What the tier's descriptors of the run's saves say, summed per (checkpoint name, save
    key, kind); a local-only save counts only where ``valid`` (checked complete) names it."""
    from dcp_volumes import tier  # as in local_tier_copies: torch only when used

    found: dict[tuple[str, str, TierKind], dict[str, Any]] = {}
    for sdir in tier.walk_saves(options.resolved_directory()):
        for d in sdir.descriptors():
            name = tier.name_under(root, d.url)
            if name is None:
                continue
            kind: TierKind = "local-copy"
            world = None
            if d.local_only is not None:
                world = valid.get((d.url, d.local_only.save_id, d.rank))
                if world is None:
                    continue  # damaged or incomplete on this node: never used
                kind = "local-only"
            _add(found.setdefault((name, sdir.save_key, kind), _entry(world)), d)
    return found


def _entry(world: int | None) -> dict[str, Any]:
    return {"ranks": set(), "world": world, "bytes": 0, "files": 0, "created": 0.0}


def _add(entry: dict[str, Any], d: Descriptor) -> None:
    entry["ranks"].add(d.rank)
    entry["bytes"] += d.nbytes
    entry["files"] += len(d.files)
    entry["created"] = max(entry["created"], d.created)
