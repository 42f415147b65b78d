"""How a :class:`~dcp_volumes.Checkpointer` resumes: the newest save that the whole group
can load -- a local-only save that continues the newest durable checkpoint, else the newest
durable checkpoint whose data verifies (:mod:`._fallback`) -- loaded through
:class:`~dcp_volumes.VolumeReader` with the Checkpointer's reading options."""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp

from dcp_volumes import _compat, catalog, errors
from dcp_volumes._api import typed_errors
from dcp_volumes.backends import redact_url
from dcp_volumes.checkpointer._fallback import candidates, load_newest
from dcp_volumes.checkpointer._policy import step_of_url
from dcp_volumes.checkpointer._resume import durable_identity, newest_local_only
from dcp_volumes.config import LocalTierOptions, RetryOptions, TransferOptions
from dcp_volumes.reader import VolumeReader
from dcp_volumes.stats import LoadStats
from dcp_volumes.tier import DurableBase, LocalCommit

__all__ = ["Restored", "Restorer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What a resume loaded: its step, the durable checkpoint it is or continues (the base
    of the next local-only save; known on rank 0) and this rank's load figures."""

    step: int | None
    base: DurableBase | None
    stats: LoadStats | None
    local_only: bool = False
    #: URLs of newer checkpoints skipped as damaged (complete, but their data did not verify)
    damaged: tuple[str, ...] = ()


@dataclass(frozen=True)
class Restorer:
    """The reading side of a Checkpointer (every field as the Checkpointer's own)."""

    root: str
    storage_options: dict[str, Any]
    step_format: str
    step_pattern: re.Pattern[str]
    transfer: TransferOptions | None
    retry: RetryOptions | None
    safe_globals: tuple[Any, ...]
    local_tier: LocalTierOptions | None
    group: Any
    distributed: bool
    rank: int

    def restore(self, state_dict: dict[str, Any]) -> Restored | None:
        """Load the save to resume from into ``state_dict`` (collective on ``group``);
        None when there is none (``state_dict`` untouched)."""
        found = candidates(self.root, storage_options=self.storage_options,
                           step_pattern=self.step_pattern, process_group=self.group,
                           alone=not self.distributed)
        info = next(found, None)
        local = self._newest_local_only(info)
        if local is not None:
            step, commit, base = local
            url = self.url_for(step)
            return Restored(step, base, self._load(state_dict, url, commit), local_only=True)
        if info is None:
            return None
        skipped: list[catalog.CheckpointInfo] = []
        loaded = load_newest(itertools.chain([info], found),
                             lambda i: self._load(state_dict, i.url, None), skipped=skipped)
        assert loaded is not None  # found was not empty
        info, stats = loaded
        base = None
        if self.local_tier is not None and self.rank == 0:
            base = self.identity(info.url)
        return Restored(info.step, base, stats, damaged=tuple(i.url for i in skipped))

    def url_for(self, step: int) -> str:
        return f"{self.root}/{self.step_format.format(step=step)}"

    def _load(self, state_dict: dict[str, Any], url: str, commit: LocalCommit | None
              ) -> LoadStats | None:
        reader = VolumeReader(url, storage_options=self.storage_options,
                              transfer=self.transfer, retry=self.retry,
                              safe_globals=self.safe_globals, local_tier=self.local_tier,
                              local_commit=commit)
        with typed_errors(lambda: reader.last_error):
            dcp.load(state_dict, storage_reader=reader, process_group=self.group,
                     **({} if self.distributed else _compat.no_dist()))
        logger.info("resumed from %s%s", redact_url(url),
                    " (a local-only save)" if commit is not None else "")
        return reader.last_stats

    def identity(self, url: str) -> DurableBase | None:
        """The durable checkpoint at ``url`` as a local-only save's base (None: unknown)."""
        try:
            return durable_identity(url, self.storage_options, self.retry)
        except errors.DCPVolumesError as exc:  # the load itself says what is wrong
            logger.debug("no lineage for %s: %s", redact_url(url), exc)
            return None

    def _newest_local_only(self, info: catalog.CheckpointInfo | None
                           ) -> tuple[int, LocalCommit, DurableBase | None] | None:
        """The newest local-only save of this run that the whole group holds, newer than
        the newest durable checkpoint ``info`` and continuing it (the same answer on every
        rank; see :func:`~dcp_volumes.checkpointer._resume.newest_local_only`)."""
        if self.local_tier is None:
            return None
        durable = (None if info is None else lambda: durable_identity(
            info.url, self.storage_options, self.retry))
        return newest_local_only(
            self.local_tier,
            step_of=lambda u: step_of_url(self.root, u, self.step_pattern, self.url_for),
            durable_step=info.step if info is not None else None, durable=durable,
            group=self.group, distributed=self.distributed)
