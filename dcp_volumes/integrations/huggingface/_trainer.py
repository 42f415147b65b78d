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
import os
from typing import Any

from dcp_volumes import errors
from dcp_volumes._dist import gloo_group
from dcp_volumes.backends import parse_url
from dcp_volumes.checkpointer import Checkpointer
from dcp_volumes.integrations.huggingface._state import capture_rng, model_optimizer_state, rng_key
from dcp_volumes.integrations.huggingface._trainer_resume import STEP_PATTERN, ResumingTrainer

__all__ = ["STEP_FORMAT", "STEP_PATTERN", "VolumeTrainer"]

#: checkpoint directory names, as the Trainer names them
STEP_FORMAT = "checkpoint-{step}"


class VolumeTrainer(ResumingTrainer):
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
            a run is refused before it trains or loads anything.
        CheckpointExistsError: (from ``train``) a fresh start (``resume_from_checkpoint``
            ``None`` or ``False``) on a ``checkpoint_root`` that holds complete
            checkpoints: its saves would replace them one step at a time while the newer
            ones stay the newest. Resume from them, or use another root.
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
        self._volume_options = {
            "storage_options": dict(storage_options or {}),
            "async_save": bool(async_save),
            # as the Trainer rewrites checkpoint-N/ when a resumed run reaches N again; the
            # replacement is atomic (the old checkpoint stays whole until the new commit)
            "overwrite": True,
            **(checkpointer_options or {}),
        }
        self._resume = None
        self._began = False
        #: what resume_path() found last: its URL passed to train() resumes with fallback
        self._found = None
        # made now, on every process (it creates process groups): a missing bucket fails here
        self.checkpointer = Checkpointer(
            self.checkpoint_root, keep_last=self.args.save_total_limit,
            step_format=STEP_FORMAT, step_pattern=STEP_PATTERN, **self._volume_options)
        self._group = gloo_group()

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

    # ---- resume (the rest: ResumingTrainer) ----------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` is ``True`` (the newest complete
        checkpoint under ``checkpoint_root``), a checkpoint URL, or ``None``/``False``."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            self.checkpointer.claim()  # a second live run is refused before it trains
            self._check_fresh(resume_from_checkpoint)  # and a fresh one over checkpoints
            out = super().train(None, trial, ignore_keys_for_eval, **kwargs)
        else:
            self.checkpointer.claim()  # a second run on the root is refused before it loads
            out = self._train_resumed(resume_from_checkpoint, trial, ignore_keys_for_eval,
                                      **kwargs)
        self.checkpointer.wait()  # the last background save has committed (or raised)
        return out
