"""Where a Checkpointer resumes from: the newest durable checkpoint in the store, or a newer
local-only save that the whole group holds and that continues exactly that checkpoint.

:func:`choose_local_only` is the pure part (what every rank's tier reported, in, the one
answer every rank computes, out); :func:`newest_local_only` runs its collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dcp_volumes import errors
from dcp_volumes._commit_read import read_committed
from dcp_volumes.backends import open_backend
from dcp_volumes.config import LocalTierOptions, RetryOptions
from dcp_volumes.tier import DurableBase, LocalCommit, LocalOnlyCopy, find_local_only, normal_url

__all__ = ["LocalChoice", "choose_local_only", "durable_identity", "newest_local_only"]

logger = logging.getLogger(__name__)

_Key = tuple[str, str, str, int, "DurableBase | None"]


@dataclass(frozen=True)
class LocalChoice:
    """The local-only save to resume from: its step, the key every rank's copy shares, and
    the group members whose tiers hold its commit files."""

    step: int
    key: _Key
    holders: tuple[int, ...]


def choose_local_only(gathered: list[Any], step_of: Callable[[str], int | None],
                      newer_than: int | None,
                      continues: Callable[[DurableBase | None], bool]) -> LocalChoice | None:
    """The newest local-only save in ``gathered`` (one list of :class:`LocalOnlyCopy` per
    group member) that every saving rank's descriptor was found for, newer than step
    ``newer_than`` (the newest durable one; None: there is none) and whose base
    ``continues`` accepts. Anything a member sent that is not a copy is ignored."""
    ranks: dict[_Key, set[int]] = {}
    holders: dict[_Key, list[int]] = {}
    created: dict[_Key, float] = {}
    for member, copies in enumerate(gathered):
        for c in copies if isinstance(copies, list) else []:
            if not isinstance(c, LocalOnlyCopy):
                continue
            ranks.setdefault(c.key(), set()).add(c.rank)
            if member not in holders.setdefault(c.key(), []):
                holders[c.key()].append(member)
            created[c.key()] = max(created.get(c.key(), 0.0), c.created)
    complete = []
    for key, got in ranks.items():
        step = step_of(key[0])
        if step is None or (newer_than is not None and step <= newer_than):
            continue
        if got != set(range(key[3])):
            logger.info("local-only save of step %d (%s) is not complete across the group "
                        "(descriptors of %d of %d ranks): not used", step, key[1], len(got),
                        key[3])
        elif not continues(key[4]):
            logger.warning("local-only save of step %d (%s) does not continue the newest "
                           "durable checkpoint in the store (another run's, or its base was "
                           "removed or replaced): not used", step, key[1])
        else:
            complete.append((step, created[key], key))
    if not complete:
        return None
    step, _, key = max(complete, key=lambda c: (c[0], c[1]))
    return LocalChoice(step, key, tuple(holders[key]))


def durable_identity(url: str, storage_options: Mapping[str, Any],
                     retry: RetryOptions | None) -> DurableBase | None:
    """The save id and manifest digest of the committed checkpoint at ``url``; None when
    it was not written by VolumeWriter (no manifest: no local-only save continues it)."""
    backend = open_backend(url, storage_options, retry)
    committed = read_committed(backend, with_manifest=True)
    if committed.manifest is None or committed.save_id is None:
        return None
    return DurableBase(normal_url(url), committed.save_id, committed.manifest.sha256)


#: the identity of a durable checkpoint that no local-only save continues (torch-written,
#: or unreadable right now: then the durable checkpoint is what a resume loads)
_NOTHING_CONTINUES = DurableBase("", "", "")


def _identity_or_sentinel(durable: Callable[[], DurableBase | None]) -> DurableBase | None:
    try:
        return durable() or _NOTHING_CONTINUES
    except Exception as exc:  # noqa: BLE001 -- the other ranks wait for this answer
        logger.warning("the newest durable checkpoint could not be read to check the lineage "
                       "of newer local-only saves (%s): resuming from the durable one",
                       type(exc).__name__)
        return _NOTHING_CONTINUES


def _broadcast(value: Any, src: int, group: Any, distributed: bool) -> Any:
    if not distributed:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, group_src=src, group=group)
    return box[0]


def newest_local_only(options: LocalTierOptions, *, step_of: Callable[[str], int | None],
                      durable_step: int | None,
                      durable: Callable[[], DurableBase | None] | None, group: Any,
                      distributed: bool
                      ) -> tuple[int, LocalCommit, DurableBase | None] | None:
    """The local-only save to resume from (its step, commit bytes, base) or None; the same
    answer on every rank. ``durable`` gives the newest durable checkpoint's identity (None:
    the store has none; called on rank 0 only, and only when some local-only save is newer
    than ``durable_step``).
    Collectives on ``group``: one all_gather_object, then broadcasts where needed."""
    mine = find_local_only(options, lambda u: step_of(u) is not None)
    found = [c.without_commit() for c in mine]
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, found, group=group)
    else:
        gathered = [found]
    if choose_local_only(gathered, step_of, durable_step, lambda base: True) is None:
        return None  # nothing newer at all: no store read
    newest: DurableBase | None = None  # no durable checkpoint: only a base-less save fits
    if durable is not None:
        me = dist.get_rank(group) if distributed else 0
        newest = _broadcast(_identity_or_sentinel(durable) if me == 0 else None, 0, group,
                            distributed)
        if not isinstance(newest, DurableBase):
            newest = _NOTHING_CONTINUES
    choice = choose_local_only(gathered, step_of, durable_step, lambda base: base == newest)
    if choice is None:
        return None
    commit = next((c.commit for c in mine if c.key() == choice.key), None)
    if distributed and len(choice.holders) < len(gathered):
        commit = _broadcast(commit, min(choice.holders), group, distributed)
    if not isinstance(commit, LocalCommit):  # cannot happen: some rank holds it
        raise errors.IntegrityError(f"the local-only save of step {choice.step} lost its "
                                    ".metadata while loading")
    return choice.step, commit, choice.key[4]
