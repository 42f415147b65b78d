"""How a :class:`~dcp_volumes.Checkpointer`'s saves are made and settled: one writer per kind
of save (kept across saves: the staging buffers belong to the process), the background save
in flight (``async_save``), and what follows a commit (retention on rank 0, the durable
checkpoint the next local-only save continues). The Checkpointer decides *when* and *which*;
this module does the saving.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_volumes import _compat, catalog, errors
from dcp_volumes._api import typed_errors
from dcp_volumes.backends import StoreLocation, redact_url
from dcp_volumes.checkpointer._autopilot import Autopilot
from dcp_volumes.checkpointer._background import Pending, watch
from dcp_volumes.checkpointer._policy import SaveKind, check_options, check_step_format, retain
from dcp_volumes.checkpointer._restore import Restored, Restorer
from dcp_volumes.config import (
    LocalTierOptions,
    RetryOptions,
    SpoolOptions,
    TransferOptions,
    check_local_tier,
)
from dcp_volumes.tier import DurableBase, replicate
from dcp_volumes.writer import VolumeWriter

__all__ = ["SaveSetup", "Saves"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveSetup:
    """What every save of one Checkpointer is made with (checked by the Checkpointer)."""

    root: str
    storage_options: dict[str, Any]
    overwrite: bool
    spool: SpoolOptions | None
    transfer: TransferOptions | None
    retry: RetryOptions | None
    local_tier: LocalTierOptions | None
    keep_last: int | None
    keep_every: int | None
    step_pattern: re.Pattern[str]
    alone: bool
    async_save: bool

    @classmethod
    def check(cls, url: str, *, storage_options: dict[str, Any] | None, overwrite: bool,
              spool: SpoolOptions | None, transfer: TransferOptions | None,
              retry: RetryOptions | None, local_tier: LocalTierOptions | None,
              keep_last: int | None, keep_every: int | None, step_format: str,
              step_pattern: str | re.Pattern[str] | None, alone: bool,
              async_save: bool) -> SaveSetup:
        """The setup of ``Checkpointer(url, ...)``, every argument checked (a
        :class:`~dcp_volumes.errors.ConfigError` says what to change)."""
        options = StoreLocation.parse(url, storage_options).options
        check_options(spool=spool, transfer=transfer, retry=retry)
        catalog.check_count("keep_last", keep_last)
        catalog.check_count("keep_every", keep_every)
        tier = check_local_tier(local_tier, spool or SpoolOptions())
        pattern = catalog.compile_step_pattern(step_pattern)
        check_step_format(step_format, pattern)
        if alone and async_save:
            raise errors.ConfigError("alone=True saves synchronously: drop async_save=True")
        return cls(url.rstrip("/") or url, options, bool(overwrite), spool, transfer, retry,
                   tier, keep_last, keep_every, pattern, bool(alone), bool(async_save))


class Saves:
    """The saving side of one Checkpointer (see the module docstring).

    Args:
        setup: what every save is made with.
        restorer: the Checkpointer's resume side (a checkpoint's identity, for lineage).
        autopilot: measures each save (``every_seconds="auto"``; a no-op otherwise).
        ctl_group: the control group (sync saves and their collectives), None alone.
        save_group: the background saves' own group (``async_save``), None otherwise.
        rank: this process's rank (0 alone).
    """

    def __init__(self, setup: SaveSetup, *, restorer: Restorer, autopilot: Autopilot,
                 ctl_group: dist.ProcessGroup | None, save_group: dist.ProcessGroup | None,
                 rank: int, distributed: bool) -> None:
        self.setup = setup
        self._restorer, self._autopilot = restorer, autopilot
        self._ctl_group, self._save_group = ctl_group, save_group
        self._rank, self._distributed = rank, distributed
        self._writers: dict[tuple[bool, bool], VolumeWriter] = {}  # (local_only, overwrite)
        #: URLs skipped as damaged at resume: the run's next save of each replaces it
        self.damaged: set[str] = set()
        self._pending: Pending | None = None
        # the durable checkpoint the next local-only save continues (rank 0 records it)
        self._base: DurableBase | None = None
        self._base_known = False
        self._lock = threading.Lock()

    def writer(self, url: str, local_only: bool) -> VolumeWriter:
        """The writer of this kind of save (one per kind, kept across saves). A step whose
        checkpoint was skipped as damaged at resume is overwritten by this save."""
        s = self.setup
        replace = url in self.damaged
        overwrite = s.overwrite or (replace and not local_only)
        if overwrite and not s.overwrite:
            logger.warning("the checkpoint at %s was skipped as damaged when this run resumed: "
                           "this save replaces it", redact_url(url))
        key = (local_only, overwrite)
        if key not in self._writers:
            self._writers[key] = VolumeWriter(
                url, storage_options=s.storage_options, overwrite=overwrite,
                spool=s.spool, transfer=s.transfer, retry=s.retry,
                local_tier=s.local_tier, local_only=local_only,
            )
        return self._writers[key]

    def start(self, step: int, url: str, kind: SaveKind, writer: VolumeWriter,
              state_dict: dict[str, Any]) -> None:
        """Save ``state_dict`` as checkpoint ``step`` through ``writer``: sync, settled on
        return; async, staged and uploading in the background."""
        started = time.monotonic()
        if not self.setup.async_save:
            no_dist = _compat.no_dist() if self.setup.alone else {}
            with typed_errors():
                dcp.save(state_dict, checkpoint_id=url, storage_writer=writer,
                         process_group=self._ctl_group, **no_dist)
            self._settle(writer, step, url, self._ctl_group)
            replicate(self.setup.local_tier, url, group=self._ctl_group)
            self._autopilot.track(kind, started, writer, None)
            return
        response = dcp.async_save(
            state_dict,
            checkpoint_id=url,
            storage_writer=writer,
            process_group=self._save_group,
            **_compat.async_executor("thread"),
        )
        self._pending = watch(step, url, _compat.upload_future(response), self._autopilot.track(
            kind, started, writer, lambda: self._settle(writer, step, url, self._save_group)))

    def _settle(self, writer: VolumeWriter, step: int, url: str,
                group: dist.ProcessGroup | None) -> None:
        """After DCP finished a save: ask the writer whether its local-only copy is complete
        (every rank asks: a collective on ``group``), or record the durable commit and
        apply retention."""
        if writer.local_only:
            # the save records the durable checkpoint it continues (see docs/guarantees.md)
            if writer.local_only_result(group=group, base=self._lineage_base):
                logger.info("local-only save of step %d written to the local tier (%s)", step,
                            redact_url(url))
            else:
                logger.warning("rank %d: the local-only save of step %d could not be "
                               "completed in the local tier: it will not be used",
                               self._rank, step)
            return
        self.damaged.discard(url)
        if writer.last_commit is not None:  # the coordinator: the next local-only save's base
            self._base, self._base_known = writer.last_commit, True
        self._after_commit(step, url)

    def _lineage_base(self) -> DurableBase | None:
        """The durable checkpoint a local-only save continues: the last one this
        Checkpointer committed or loaded, else the newest in the store (looked up once)."""
        if not self._base_known:
            s = self.setup
            info = catalog.latest(s.root, storage_options=s.storage_options,
                                  step_pattern=s.step_pattern, broadcast=False)
            self._base = self._restorer.identity(info.url) if info is not None else None
            self._base_known = True
        return self._base

    def _after_commit(self, step: int, url: str) -> None:
        logger.info("checkpoint of step %d committed at %s", step, redact_url(url))
        s = self.setup
        if self._rank == 0 and (s.keep_last is not None or s.keep_every is not None):
            retain(s.root, step, keep_last=s.keep_last, keep_every=s.keep_every,
                   storage_options=s.storage_options, step_pattern=s.step_pattern)

    def resumed(self, restored: Restored | None) -> None:
        """``load_latest`` restored ``restored`` (None: nothing): the lineage's base and the
        damaged checkpoints the next saves replace."""
        self._base_known = True
        self._base = restored.base if restored is not None else None
        if restored is not None:
            self.damaged = set(restored.damaged)

    def finish_pending(self) -> None:
        """Wait for the background save in flight (if any); raise if it failed."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.result()
        # partner replicas of a background save: on the caller's thread (a collective on the
        # control group, which every rank reaches here after the same save)
        replicate(self.setup.local_tier, pending.url, group=self._ctl_group)

    def upload_idle(self) -> bool:
        """No background save in flight (``drain``). Rank 0 decides for everyone: its save
        settles only after the commit, which follows every rank's upload."""
        with self._lock:
            pending = self._pending
        idle = pending is None or pending.done.done()
        if self._distributed:
            box: list[Any] = [idle]
            dist.broadcast_object_list(box, group_src=0, group=self._ctl_group)
            idle = bool(box[0])
        return idle

    def close_writers(self) -> None:
        """Free the staging buffers."""
        for writer in self._writers.values():
            writer.close()
