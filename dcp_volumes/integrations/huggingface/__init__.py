"""Hugging Face Accelerate and the transformers ``Trainer``, checkpointing through dcp_volumes.

* :func:`save_state` / :func:`load_state` -- what ``Accelerator.save_state`` /
  ``load_state`` save (models, optimizers, schedulers, sampler states, scaler, registered
  objects, step, RNG), as one DCP checkpoint at a store URL (needs ``accelerate``).
* :class:`VolumeTrainer` -- a ``transformers.Trainer`` that saves every ``save_steps`` to
  ``checkpoint_root``, keeps ``save_total_limit`` checkpoints and resumes from the newest
  complete one (needs ``transformers``; imported when first used).
* :func:`accelerator_state` / :func:`restore_accelerator_state` -- that state dict itself,
  and putting a loaded one back, to use with a :class:`~dcp_volumes.Checkpointer` (policy,
  retention, resume from the newest).

Example::

    from dcp_volumes.integrations.huggingface import VolumeTrainer

    trainer = VolumeTrainer(model=model, args=args, train_dataset=ds,
                            checkpoint_root="s3://bucket/run-42")
    trainer.train(resume_from_checkpoint=trainer.resume_path())  # None: start fresh

Modules: ``_state`` (model/optimizer/RNG state, framework-neutral), ``_accelerate``,
``_trainer`` (the trainer and its save; its resume in ``_trainer_resume``). See
``docs/integrations/huggingface.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dcp_volumes.integrations.huggingface._accelerate import (
    accelerator_state,
    load_state,
    restore_accelerator_state,
    save_state,
)

if TYPE_CHECKING:
    from dcp_volumes.integrations.huggingface._trainer import VolumeTrainer

__all__ = [
    "VolumeTrainer",
    "accelerator_state",
    "load_state",
    "restore_accelerator_state",
    "save_state",
]


def __getattr__(name: str) -> Any:
    if name == "VolumeTrainer":  # transformers only for Trainer users
        value = importlib.import_module("dcp_volumes.integrations.huggingface._trainer")
        return value.VolumeTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
