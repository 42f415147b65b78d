"""``VolumeTrainer``: a transformers ``Trainer`` whose checkpoints go to a store URL.

The ``Trainer`` writes ``checkpoint-N/`` directories of ``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state_<r>.pth`` and ``trainer_state.json`` to a
local ``output_dir`` (and under FSDP calls Accelerate's ``save_fsdp_*``, which hard-code
torch's ``FileSystemWriter``), rotates them by modification time and resumes by listing that
directory. A callback cannot replace that (``on_save`` runs after the files are written), so
this subclass overrides the hooks the Trainer calls:

* ``_save_checkpoint`` -> one DCP save through :class:`~dcp_volumes.Checkpointer` of
  :meth:`VolumeTrainer.checkpoint_state` to ``{checkpoint_root}/checkpoint-{global_step}``:
  the model and optimizer (canonical FQNs, sharded under FSDP), the scheduler, the scaler,
  each process's RNG states and ``trainer_state.json`` as items of the same save; retention
  (``save_total_limit``) is the Checkpointer's ``keep_last``;
* ``train(resume_from_checkpoint=True)`` -> :func:`dcp_volumes.catalog.latest` (one listing,
  on rank 0, broadcast) picks the newest *complete* checkpoint; its trainer state is written
  to a private temporary directory that the stock ``train`` reads, and the
  ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` / ``_load_scaler`` /
  ``_load_rng_state`` hooks take their state from the store instead of files. When its
  data does not verify (a damaged byte), the stock ``train`` stops before its first step;
  it is started again from the next older complete checkpoint, with a WARNING naming the
  one skipped (the Checkpointer's resume loop, :mod:`dcp_volumes.checkpointer`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any, Literal

import torch.distributed as dist
from transformers import Trainer

from dcp_volumes import _api, catalog, errors
from dcp_volumes._dist import gloo_group
from dcp_volumes.backends import parse_url, redact_url
from dcp_volumes.checkpointer import Checkpointer, candidates, load_newest
from dcp_volumes.integrations.huggingface._state import (
    OptionalKeysPlanner,
    apply_rng,
    capture_rng,
    load_model_optimizers,
    model_optimizer_state,
    rng_key,
)

__all__ = ["STEP_FORMAT", "STEP_PATTERN", "VolumeTrainer"]

logger = logging.getLogger(__name__)

#: checkpoint directory names, as the Trainer names them
STEP_FORMAT = "checkpoint-{step}"
STEP_PATTERN = r"^checkpoint-(?P<step>\d+)$"
_TRAINER_STATE_NAME = "trainer_state.json"  # what Trainer.train reads from the resume dir


@dataclasses.dataclass
class _Resume:
    """The checkpoint being resumed from, while ``train`` runs."""

    url: str
    local: str  # the directory handed to Trainer.train (holds trainer_state.json only)
    rng: dict[str, Any] | None


class VolumeTrainer(Trainer):
    """A ``transformers.Trainer`` that saves its checkpoints to ``checkpoint_root`` (any
    fsspec URL) through dcp_volumes and resumes from the newest complete one there.

    ``save_steps`` / ``save_strategy`` decide when to save (as usual); ``save_total_limit``
    keeps the newest N complete checkpoints. ``output_dir`` stays a local directory for logs
    and ``save_model``. ``train(resume_from_checkpoint=trainer.resume_path())`` starts fresh
    when nothing is stored yet and resumes from the newest complete checkpoint otherwise.
    ``train(resume_from_checkpoint=True)`` resumes from the newest
    complete checkpoint under ``checkpoint_root`` (raising
    :class:`~dcp_volumes.errors.CheckpointNotFoundError` when there is none, as the Trainer
    raises when ``output_dir`` has none); a string is the URL of one checkpoint to resume
    from. The world size may change between save and resume.

    Args:
        *args: as for ``Trainer``.
        checkpoint_root: the run's root, e.g. ``"s3://bucket/run-42"``.
        storage_options: passed to fsspec unchanged; never logged.
        async_save: upload in the background (:class:`~dcp_volumes.Checkpointer`'s
            ``async_save``); ``train`` returns after the last upload committed.
        checkpointer_options: further :class:`~dcp_volumes.Checkpointer` keywords
            (``spool``, ``transfer``, ``retry``, ``keep_every``, ``safe_globals``, ...).
            ``overwrite`` is on by default: a run resumed from an older checkpoint replaces
            the newer ones as it reaches their steps again, as the Trainer does locally
            (atomically: a replaced checkpoint stays whole until the new one commits).
        **kwargs: as for ``Trainer``.

    Raises:
        ConfigError: ``load_best_model_at_end`` (it reads a local checkpoint directory),
            or a bad ``checkpoint_root``.
        BucketNotFoundError: the bucket of ``checkpoint_root`` does not exist (checked here,
            not at the first save).
        RootInUseError: (from ``train``) another live run saves under ``checkpoint_root``;
            a run resuming is refused before it loads anything.
    """

    def __init__(self, *args: Any, checkpoint_root: str | os.PathLike[str],
                 storage_options: dict[str, Any] | None = None, async_save: bool = False,
                 checkpointer_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise errors.ConfigError(
                "VolumeTrainer does not support load_best_model_at_end (the Trainer reloads "
                "the best checkpoint from a local directory): set it to False")
        root = os.fspath(checkpoint_root)
        parse_url(root)
        self.checkpoint_root = root.rstrip("/") or root
        self._volume_options: dict[str, Any] = {
            "storage_options": dict(storage_options or {}),
            "async_save": bool(async_save),
            # as the Trainer rewrites checkpoint-N/ when a resumed run reaches N again; the
            # replacement is atomic (the old checkpoint stays whole until the new commit)
            "overwrite": True,
            **(checkpointer_options or {}),
        }
        self._resume: _Resume | None = None
        self._began = False
        #: what resume_path() found last: its URL passed to train() resumes with fallback
        self._found: catalog.CheckpointInfo | None = None
        # made now, on every process (it creates process groups): a missing bucket fails here
        self.checkpointer = Checkpointer(
            self.checkpoint_root, keep_last=self.args.save_total_limit,
            step_format=STEP_FORMAT, step_pattern=STEP_PATTERN, **self._volume_options)
        self._group: dist.ProcessGroup | None = gloo_group()

    @property
    def _storage_options(self) -> dict[str, Any]:
        return dict(self._volume_options["storage_options"])

    # ---- save ------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """The DCP state dict every checkpoint saves (and resume loads into): ``model``,
        ``trainer_state`` and, unless ``save_only_model``, ``optimizer``, ``scheduler``,
        ``scaler`` and ``rng.rank-<process_index>``. Override to add items (on load they must
        be there, with the same structure)."""
        with_optimizer = not self.args.save_only_model
        models, optims = model_optimizer_state(
            [self.model_wrapped], [self.optimizer] if with_optimizer else [])
        state: dict[str, Any] = {"model": models["0"], "trainer_state": self._state_json()}
        if with_optimizer:
            state["optimizer"] = optims["0"]
            if self.lr_scheduler is not None:
                state["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = {rng_key(self.args.process_index): capture_rng()}
        return state

    def _state_json(self) -> str:
        # as Trainer._save_checkpoint: exportable callbacks record their state first
        from transformers.trainer_callback import ExportableState

        recorded: Any = self.state.stateful_callbacks  # a dict once training runs
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(recorded.get(name), list):
                    recorded[name].append(cb.state())
                else:
                    recorded[name] = cb.state()
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if trial is not None or self.hp_search_backend is not None:
            raise errors.ConfigError(
                "VolumeTrainer does not save hyperparameter-search trials: use Trainer")
        self.store_flos()
        self.checkpointer.save(self.state.global_step, self.checkpoint_state(), force=True)

    # ---- resume ----------------------------------------------------------------------------
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

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` is ``True`` (the newest complete
        checkpoint under ``checkpoint_root``), a checkpoint URL, or ``None``/``False``."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            out = super().train(None, trial, ignore_keys_for_eval, **kwargs)
        else:
            self.checkpointer.claim()  # a second run on the root is refused before it loads
            out = self._train_resumed(resume_from_checkpoint, trial, ignore_keys_for_eval,
                                      **kwargs)
        self.checkpointer.wait()  # the last background save has committed (or raised)
        return out

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
