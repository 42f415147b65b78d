"""torchtitan checkpoints through dcp_volumes: a ``CheckpointManager`` that torchtitan builds.

torchtitan's own manager hands ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` a bare
``checkpoint_id``, so an ``s3://`` folder goes to torch's ``FsspecWriter``; it finds the step
to resume from with one listing plus up to two probes per step directory, and its retention
counts ``step-N`` directories by name and removes them recursively, so a half-deleted
checkpoint can look complete to the next job. :class:`VolumeCheckpointManager` keeps every
policy of torchtitan's manager (interval, ``keep_latest_k``, async modes, ``load_step``,
``exclude_from_loading``, the last-step export, the ``step-N`` names) and changes only where
the bytes go and how the run root is read:

- saves go through :class:`~dcp_volumes.VolumeWriter` (sync, ``async``, and
  ``async_with_pinned_mem`` where torch's pinned-memory stager runs the upload in a process
  that receives the writer pickled), loads through :class:`~dcp_volumes.VolumeReader`;
- the newest complete step is :func:`dcp_volumes.catalog.latest` (one listing, on rank 0,
  broadcast); a step directory without a committed ``.metadata`` is skipped, and so is one
  whose data does not verify when loaded (a WARNING names it; the next older one loads:
  the Checkpointer's resume loop);
- retention is :func:`dcp_volumes.catalog.apply_retention` (``.metadata`` removed first; only
  checkpoints that load count toward ``keep_latest_k``), run on rank 0 in torchtitan's own
  purge thread.

Selected from torchtitan's configuration, with no edit to torchtitan: a ``config_registry``
function (``--module``/``--config``) sets ``checkpoint=VolumeCheckpointManager.Config(...)``
on the trainer's config, and ``--checkpoint.*`` flags override its fields as usual. See
``docs/integrations/torchtitan.md``.

This module imports torchtitan at its top: only users of torchtitan import it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer.base import MODEL, purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.utils import GarbageCollection

import dcp_volumes
from dcp_volumes import catalog
from dcp_volumes._dist import gloo_group
from dcp_volumes.backends import redact_url
from dcp_volumes.checkpointer import candidates, load_newest
from dcp_volumes.config import SpoolOptions
from dcp_volumes.integrations._torchtitan_config import VolumeCheckpointConfig, use_volumes
from dcp_volumes.writer import VolumeWriter

__all__ = ["STEP_PATTERN", "VolumeCheckpointManager", "use_volumes"]

logger = logging.getLogger(__name__)

#: torchtitan's step directory names (``CheckpointManager._create_checkpoint_id``: ``step-N``)
STEP_PATTERN = r"^step-(?P<step>\d+)$"


class VolumeCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with dcp_volumes as the storage, listing and retention.

    Built by torchtitan from ``Trainer.Config.checkpoint`` (``config.checkpoint.build(...)``)
    like the manager it replaces; its constructor takes the same arguments.
    """

    purge_thread: threading.Thread | None

    Config = VolumeCheckpointConfig  # built by torchtitan: config.checkpoint.build(...)

    def __init__(self, config: VolumeCheckpointConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.storage_options = config.fsspec_options()
        self.keep_every = config.keep_every
        self.overwrite = config.overwrite
        self.verify = config.verify
        self.spool = SpoolOptions(mode=config.spool_mode, directory=config.spool_dir or None)
        #: step URLs skipped as damaged at resume: the next save of each replaces it
        self._damaged: set[str] = set()
        self._list_group = self.pg if self.pg is not None else _listing_group()
        if self.purge_thread is not None:
            # torchtitan's purge thread removes step directories by name, recursively: put
            # ours in its place, fed by the same queue and run by the same loop.
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._apply_retention), daemon=True)
            self.purge_thread.start()

    # ----------------------------------------------------------------------------------------
    # saving and loading: the same DCP calls as torchtitan's, with our writer and reader

    def _writer(self, checkpoint_id: str) -> VolumeWriter:
        # a step skipped as damaged at resume is still complete: its next save replaces it
        replace = checkpoint_id in self._damaged
        if replace and not self.overwrite:
            logger.warning("%s was skipped as damaged when this run resumed: this save "
                           "replaces it", redact_url(checkpoint_id))
        self._damaged.discard(checkpoint_id)
        return VolumeWriter(checkpoint_id, storage_options=self.storage_options,
                            overwrite=self.overwrite or replace, spool=self.spool)

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        """Save ``state_dict`` to ``checkpoint_id`` through :class:`~dcp_volumes.VolumeWriter`.

        Returns what torchtitan's ``dcp_save`` returns: ``None`` (sync), the upload future
        (``async``), or the ``AsyncSaveResponse`` (``async_with_pinned_mem``). A Hugging Face
        export (``to_hf``, local folders only) is left to torchtitan's own writer.
        """
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        writer = self._writer(checkpoint_id)
        ret: Future[Any] | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            # the writer is its own stager: a copy into reused CPU buffers, then a thread
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torch's pinned-memory stager; the upload runs in a process that gets the writer
            # pickled (it holds only its configuration)
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                 async_stager=self.stager)
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load ``checkpoint_id`` into ``state_dict`` through :class:`~dcp_volumes.VolumeReader`
        (resharded by DCP's planner when the world size changed). A Hugging Face load is left
        to torchtitan's own reader."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        # dcp.load, raising the typed error (a damaged checkpoint: IntegrityError)
        dcp_volumes.load(state_dict, checkpoint_id, storage_options=self.storage_options,
                         verify=self.verify)
        # torchtitan flattens the model's entries into the top level: hand them to the model
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    @sl.log_trace_span("checkpoint_load")
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (``-1``: the newest complete step under the folder whose data
        verifies; a damaged one is skipped with a WARNING naming it, as the Checkpointer's
        resume does).

        With nothing complete under the folder, torchtitan's initial load runs
        (``initial_load_path``, Hugging Face assets) when one is configured; otherwise this is
        a fresh start. Unlike torchtitan's, this never probes the folder with fsspec first.
        """
        if step != -1:
            return self._load_step(step)
        found = (i for i in candidates(self.folder, storage_options=self.storage_options,
                                       step_pattern=STEP_PATTERN,
                                       process_group=self._list_group)
                 if i.step is not None)
        skipped: list[Any] = []
        loaded = load_newest(found, lambda info: self._load_step(int(info.step or 0)),
                             skipped=skipped)
        self._damaged = {self._create_checkpoint_id(int(i.step)) for i in skipped}
        if loaded is not None:
            return True
        if self.initial_load_path or self.initial_load_in_hf:
            return bool(super()._load(step))
        logger.info("No complete checkpoint under %s: a fresh start.", redact_url(self.folder))
        return False

    def _load_step(self, load_step: int) -> bool:
        """Load checkpoint ``load_step`` of the folder."""
        checkpoint_id = self._create_checkpoint_id(load_step)
        logger.info("Loading the checkpoint from %s.", redact_url(checkpoint_id))
        begin = time.monotonic()
        # step 0 is torchtitan's seed checkpoint: model only
        states = self._states_to_load(model_only=load_step == 0)
        self.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info("Finished loading the checkpoint in %.2f seconds.", time.monotonic() - begin)
        return True

    # ----------------------------------------------------------------------------------------
    # the run root: latest and retention through the catalog

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step under ``folder`` (default: the checkpoint folder) that loads, or -1.

        One listing, on rank 0 of the group, broadcast to every rank (every rank calls this);
        a step whose ``.metadata`` is missing (being written, killed, being deleted) or does
        not load is skipped.
        """
        info = catalog.latest(folder or self.folder, storage_options=self.storage_options,
                              step_pattern=STEP_PATTERN, process_group=self._list_group)
        if info is None or info.step is None:
            return -1
        return info.step

    def _purge_stale_checkpoints(self) -> None:
        """Queue retention for the purge thread, on rank 0, when ``keep_latest_k`` > 0."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.keep_latest_k > 0 and rank == 0:
            assert self.purge_thread is not None
            self.purge_queue.put(self.folder)

    def _apply_retention(self, folder: str) -> None:
        """Keep the newest ``keep_latest_k`` checkpoints that load (and every ``keep_every``);
        run in the purge thread, which logs a failure and goes on."""
        removed = catalog.apply_retention(
            folder, keep_last=self.keep_latest_k, keep_every=self.keep_every or None,
            storage_options=self.storage_options, step_pattern=STEP_PATTERN)
        for url in removed:
            logger.info("Retention removed %s.", redact_url(url))


def _listing_group() -> dist.ProcessGroup | None:
    """The group of the catalog's broadcast: the default one when it is gloo (None), else
    the shared gloo group. Every rank builds the manager, so every rank joins."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return None
    return gloo_group()  # type: ignore[no-any-return]
