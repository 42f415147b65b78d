"""The resume half of :class:`~dcp_volumes.integrations.huggingface.VolumeTrainer`: the
checkpoint to resume from (the newest complete one under the root, with the Checkpointer's
fallback past a damaged one, or a URL), its trainer state handed to the stock ``train``
through a private temporary directory, and the ``Trainer``'s loading hooks taking the
model, optimizer, scheduler, scaler and RNG states from the store instead of files.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any, Literal

import torch.distributed as dist
from transformers import Trainer

from dcp_volumes import _api, catalog, errors
from dcp_volumes.backends import parse_url, redact_url
from dcp_volumes.checkpointer import Checkpointer, candidates, load_newest
from dcp_volumes.integrations.huggingface._state import (
    OptionalKeysPlanner,
    apply_rng,
    capture_rng,
    load_model_optimizers,
    rng_key,
)

__all__ = ["STEP_PATTERN", "ResumingTrainer"]

# the public module's logger: what users filter on stays one name
logger = logging.getLogger("dcp_volumes.integrations.huggingface._trainer")

#: checkpoint directory names, as the Trainer names them
STEP_PATTERN = r"^checkpoint-(?P<step>\d+)$"
_TRAINER_STATE_NAME = "trainer_state.json"  # what Trainer.train reads from the resume dir


@dataclasses.dataclass
class _Resume:
    """The checkpoint being resumed from, while ``train`` runs."""

    url: str
    local: str  # the directory handed to Trainer.train (holds trainer_state.json only)
    rng: dict[str, Any] | None


class ResumingTrainer(Trainer):
    """A ``Trainer`` that resumes from checkpoints in a store (see the module); the save
    half, and what sets the attributes below, is
    :class:`~dcp_volumes.integrations.huggingface.VolumeTrainer`."""

    checkpoint_root: str
    checkpointer: Checkpointer
    _group: dist.ProcessGroup | None
    _resume: _Resume | None
    _began: bool
    _found: catalog.CheckpointInfo | None
    _volume_options: dict[str, Any]  # the Checkpointer's keywords, storage_options first

    @property
    def _storage_options(self) -> dict[str, Any]:
        return dict(self._volume_options["storage_options"])

    def checkpoint_state(self) -> dict[str, Any]:
        """The DCP state dict every checkpoint saves and resume loads into."""
        raise NotImplementedError

    def resume_path(self) -> str | None:
        """The URL of the newest complete checkpoint under ``checkpoint_root``, or ``None``
        when there is none: ``trainer.train(resume_from_checkpoint=trainer.resume_path())``
        starts fresh on a first run and resumes on the next ones.

        One listing, on rank 0, broadcast (every process calls this: the answer is the same
        on all of them). When the data of the checkpoint it names turns out damaged while
        ``train`` loads it, ``train`` goes on to the next older complete one, as for
        ``resume_from_checkpoint=True``.
        """
        self._found = catalog.latest(self.checkpoint_root, storage_options=self._storage_options,
                                     step_pattern=STEP_PATTERN, process_group=self._group)
        return self._found.url if self._found is not None else None

    def _check_fresh(self, resume: None | Literal[False]) -> None:
        """Refuse a fresh start on a root that holds complete checkpoints (one listing, on
        rank 0, broadcast). Its saves would replace them one step at a time, the newer ones
        staying the newest: a resume in between would continue the other run, and retention
        would remove this run's saves first.

        Raises:
            CheckpointExistsError: there is one; the message names the newest.
        """
        found = catalog.latest(self.checkpoint_root, storage_options=self._storage_options,
                               step_pattern=STEP_PATTERN, process_group=self._group)
        if found is None:
            return
        raise errors.CheckpointExistsError(
            f"{redact_url(self.checkpoint_root)} already holds complete checkpoints (the "
            f"newest is {found.name}), and train(resume_from_checkpoint={resume!r}) starts "
            "fresh: its saves would replace them one step at a time while the newer ones "
            "stay the newest, so a resume in between would continue the other run. Resume "
            "from them (train(resume_from_checkpoint=trainer.resume_path())), use another "
            "checkpoint_root, or remove them first (dcp-volumes rm)")

    def _train_resumed(self, resume: str | bool, *args: Any, **kwargs: Any) -> Any:
        """The stock ``train`` from the checkpoint named, or from the newest one under the
        root that verifies (the Checkpointer's resume loop; also for the URL that
        :meth:`resume_path` returned)."""
        found: Iterator[catalog.CheckpointInfo]
        if isinstance(resume, str):
            parse_url(resume)
            if self._found is None or resume != self._found.url:
                return self._train_from(resume, *args, **kwargs)
            found = self._from_found(self._found)
        else:
            found = candidates(self.checkpoint_root, storage_options=self._storage_options,
                               step_pattern=STEP_PATTERN, process_group=self._group)
        loaded = load_newest(
            found, lambda info: self._train_from(info.url, *args, **kwargs),
            while_loading=lambda: not self._began)
        if loaded is None:
            raise errors.CheckpointNotFoundError(
                f"no complete checkpoint under {redact_url(self.checkpoint_root)} to resume "
                "from: pass resume_from_checkpoint=trainer.resume_path(), which is None (start "
                "fresh) when nothing is stored yet")
        return loaded[1]

    def _from_found(self, first: catalog.CheckpointInfo) -> Iterator[catalog.CheckpointInfo]:
        """What :meth:`resume_path` found, then (only when it is damaged) the older complete
        checkpoints, listed again on rank 0 and broadcast."""
        yield first
        older = candidates(self.checkpoint_root, storage_options=self._storage_options,
                           step_pattern=STEP_PATTERN, process_group=self._group)
        yield from (i for i in older if i.step is not None and first.step is not None
                    and i.step < first.step)

    def _train_from(self, url: str, *args: Any, **kwargs: Any) -> Any:
        """The stock ``train``, resuming from checkpoint ``url``."""
        self._began = False  # until the model and optimizer came from it
        with tempfile.TemporaryDirectory(prefix="dcpv-hf-resume-") as local:
            self._resume = self._load_small(url, local)
            try:
                return super().train(local, *args, **kwargs)
            finally:
                self._resume = None

    def _load_small(self, url: str, local: str) -> _Resume:
        """The trainer state (written to ``local`` for the stock ``train`` to read) and this
        process's RNG state, before the model and optimizer exist in their final form."""
        key = rng_key(self.args.process_index)
        state: dict[str, Any] = {"trainer_state": "", "rng": {key: capture_rng()}}
        planner = OptionalKeysPlanner(optional=("rng.",))
        # a few KiB: every rank reads its own (a cooperative plan's collectives cost more)
        self._load(state, url, planner, cooperative=False)
        with open(os.path.join(local, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(state["trainer_state"])
        logger.info("resuming from %s", redact_url(url))
        return _Resume(url=url, local=local,
                       rng=None if planner.missing else state["rng"][key])

    def _load(self, state: dict[str, Any], url: str, planner: Any = None,
              cooperative: bool | Literal["auto"] = "auto") -> None:
        """One ``dcp.load`` of ``url`` with the Checkpointer's reading options (transfer,
        retry, local tier, allowed globals), as its own ``load_latest`` reads."""
        c = self.checkpointer
        _api.load(state, url, storage_options=self._storage_options, planner=planner,
                  process_group=self._group, safe_globals=c.safe_globals,
                  transfer=c.transfer, retry=c.retry, local_tier=c.local_tier,
                  cooperative=cooperative)

    def _ours(self, checkpoint: str | None) -> bool:
        return self._resume is not None and checkpoint == self._resume.local

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ours(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the model loads with the optimizer, once both are prepared

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self._resume is not None
        state = self.checkpoint_state()
        del state["trainer_state"]
        state.pop("rng", None)  # loaded (and applied where the Trainer does) by _load_small
        self._load(state, self._resume.url)
        load_model_optimizers([self.model_wrapped],
                              [self.optimizer] if "optimizer" in state else [],
                              {"0": state["model"]}, {"0": state.get("optimizer")})
        self._began = True
        if "scheduler" in state and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["scheduler"])
        if "scaler" in state:
            self.accelerator.scaler.load_state_dict(state["scaler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        assert self._resume is not None
        if self._resume.rng is None:
            logger.info("no RNG state for process %d in the checkpoint: reproducibility of "
                        "random draws is not guaranteed", self.args.process_index)
            return
        apply_rng(self._resume.rng)
