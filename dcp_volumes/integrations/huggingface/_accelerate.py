"""``save_state`` / ``load_state``: what ``Accelerator.save_state`` / ``load_state`` save, as
one DCP checkpoint through :class:`~dcp_volumes.VolumeWriter` / :class:`~dcp_volumes.VolumeReader`.

Accelerate's own functions write ``model.safetensors``, ``optimizer.bin``, ... to a local
directory, and for FSDP call ``save_fsdp_model`` / ``save_fsdp_optimizer``, which hard-code
torch's ``FileSystemWriter`` on a local path. Here every piece is an item of one DCP save:

================  ===========================================================================
``models.<i>``    ``get_model_state_dict`` of ``accelerator._models[i]`` (sharded under FSDP)
``optimizers.<i>`` ``get_optimizer_state_dict`` (paired with model ``i``, or the only model)
``schedulers.<i>`` ``scheduler.state_dict()``
``samplers.<i>``  the epoch and seed of a prepared dataloader's ``SeedableRandomSampler``, or a
                  stateful dataloader's ``state_dict()``
``scaler``        the ``GradScaler`` state, when there is one
``custom.<i>``    ``state_dict()`` of each object given to ``register_for_checkpointing``
``step``          ``accelerator.step``
``rng.rank-<r>``  each process's Python, NumPy, torch (and CUDA) RNG states
================  ===========================================================================

so the ``.metadata`` commit covers all of it, replicated tensors (DDP) are written once, and a
load reshards to the world size it runs on (a process whose RNG state the checkpoint lacks
keeps its own).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import SeedableRandomSampler

from dcp_volumes import _api, errors
from dcp_volumes.backends import redact_url
from dcp_volumes.integrations.huggingface._state import (
    OptionalKeysPlanner,
    apply_rng,
    capture_rng,
    load_model_optimizers,
    model_optimizer_state,
    rng_key,
)
from dcp_volumes.reader import VolumeReader
from dcp_volumes.writer import VolumeWriter

__all__ = ["accelerator_state", "load_state", "restore_accelerator_state", "save_state"]

logger = logging.getLogger(__name__)


def _check(accelerator: Any) -> Accelerator:
    if not isinstance(accelerator, Accelerator):
        raise errors.ConfigError(
            f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.distributed_type.value in ("DEEPSPEED", "MEGATRON_LM", "XLA"):
        raise errors.ConfigError(
            f"{accelerator.distributed_type.value} keeps its own checkpoint format: use "
            "accelerator.save_state / load_state for it")
    return accelerator


def _seedable_sampler(dataloader: Any) -> SeedableRandomSampler | None:
    """The ``SeedableRandomSampler`` of a prepared dataloader. ``get_sampler()`` misses it
    on more than one process (the batch sampler is then a ``BatchSamplerShard`` around the
    one that holds it), so look there too."""
    get = getattr(dataloader, "get_sampler", None)
    sampler = get() if get is not None else None
    if sampler is None:
        inner = getattr(getattr(dataloader, "batch_sampler", None), "batch_sampler", None)
        sampler = getattr(inner, "sampler", None)
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _sampler_state(dataloader: Any) -> dict[str, Any] | None:
    if getattr(dataloader, "use_stateful_dataloader", False):
        return {"stateful": dataloader.state_dict()}
    sampler = _seedable_sampler(dataloader)
    if sampler is not None:
        return {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    return None


def _set_sampler_state(dataloader: Any, state: dict[str, Any]) -> None:
    if "stateful" in state:
        dataloader.load_state_dict(state["stateful"])
        return
    sampler = _seedable_sampler(dataloader)
    if sampler is None:
        raise errors.ConfigError(
            "the checkpoint has a sampler state for a dataloader whose sampler is not "
            "seedable: prepare the same dataloaders, with the same DataLoaderConfiguration")
    sampler.epoch, sampler.initial_seed = int(state["epoch"]), int(state["initial_seed"])


def accelerator_state(accelerator: Accelerator) -> dict[str, Any]:
    """The DCP state dict of everything ``accelerator.save_state`` saves (see the module
    docstring); on load it is the template that ``dcp.load`` fills in place."""
    models, optims = model_optimizer_state(accelerator._models, accelerator._optimizers)
    state: dict[str, Any] = {
        "models": models,
        "optimizers": optims,
        "schedulers": {str(i): s.state_dict() for i, s in enumerate(accelerator._schedulers)},
        "custom": {str(i): o.state_dict() for i, o in enumerate(accelerator._custom_objects)},
        "step": int(accelerator.step),
        "rng": {rng_key(accelerator.process_index): capture_rng()},
    }
    samplers = {str(i): s for i, dl in enumerate(accelerator._dataloaders)
                if (s := _sampler_state(dl)) is not None}
    if samplers:
        state["samplers"] = samplers
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler.state_dict()
    return state


def save_state(
    accelerator: Accelerator,
    url: str | os.PathLike[str],
    /,
    *,
    storage_options: dict[str, Any] | None = None,
    **writer_options: Any,
) -> VolumeWriter:
    """Save what ``accelerator.save_state`` saves, as one DCP checkpoint at ``url``.

    Every process calls it (a collective). Returns the writer (``last_stats``).

    Args:
        accelerator: the ``Accelerator`` whose prepared models, optimizers, schedulers,
            dataloaders and registered objects are saved.
        url: the checkpoint's URL (``s3://bucket/run/step-100``, any fsspec URL, a path).
        storage_options: passed to fsspec unchanged; never logged.
        **writer_options: :class:`~dcp_volumes.VolumeWriter` keywords (``overwrite``,
            ``spool``, ``transfer``, ``retry``, ...).

    Raises:
        ConfigError: a DeepSpeed / Megatron-LM / XLA accelerator, or models and optimizers
            that cannot be paired.
        DCPVolumesError: the save failed (``CheckpointExistsError`` when ``url`` holds a
            complete checkpoint and ``overwrite`` is off).
    """
    acc = _check(accelerator)
    writer = _api.save(accelerator_state(acc), url, storage_options=storage_options,
                       **writer_options)
    acc.project_configuration.iteration += 1  # as accelerator.save_state counts saves
    logger.info("accelerator state saved to %s", redact_url(os.fspath(url)))
    return writer


def load_state(
    accelerator: Accelerator,
    url: str | os.PathLike[str],
    /,
    *,
    storage_options: dict[str, Any] | None = None,
    **reader_options: Any,
) -> VolumeReader:
    """Load a :func:`save_state` checkpoint into ``accelerator``'s prepared objects, in place
    (what ``accelerator.load_state`` restores, ``accelerator.step`` included).

    Every process calls it (a collective); the world size may differ from the save's (the
    state is resharded; a process the save did not have keeps its RNG state, as Accelerate
    does when its RNG file is missing). The same objects must be prepared / registered, in
    the same order, as at the save. Returns the reader (``last_stats``).

    Raises:
        CheckpointNotFoundError: nothing at ``url``.
        IncompleteCheckpointError: shards but no ``.metadata`` (an interrupted save).
        DCPVolumesError: the load failed (a missing model key, a damaged item, ...).
    """
    acc = _check(accelerator)
    state = accelerator_state(acc)
    planner = OptionalKeysPlanner(optional=("rng.",))
    reader = _api.load(state, url, storage_options=storage_options, planner=planner,
                       **reader_options)
    if planner.missing:
        logger.info("no RNG state for process %d in %s: keeping this process's",
                    acc.process_index, redact_url(os.fspath(url)))
        del state["rng"]
    restore_accelerator_state(acc, state)
    return reader


def restore_accelerator_state(accelerator: Accelerator, state: dict[str, Any]) -> None:
    """Put a loaded :func:`accelerator_state` back into ``accelerator``'s objects (what
    :func:`load_state` does after its ``dcp.load``; for a state loaded another way, e.g. by
    :meth:`~dcp_volumes.Checkpointer.load_latest`). Without an ``rng`` entry for this process,
    its RNG state is left as it is."""
    acc = _check(accelerator)
    load_model_optimizers(acc._models, acc._optimizers, state["models"], state["optimizers"])
    for i, scheduler in enumerate(acc._schedulers):
        scheduler.load_state_dict(state["schedulers"][str(i)])
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(state["custom"][str(i)])
    for i, dataloader in enumerate(acc._dataloaders):
        if str(i) in state.get("samplers", {}):
            _set_sampler_state(dataloader, state["samplers"][str(i)])
    if acc.scaler is not None:
        acc.scaler.load_state_dict(state["scaler"])
    acc.step = int(state["step"])
    mine = state.get("rng", {}).get(rng_key(acc.process_index))
    if mine is not None:
        apply_rng(mine)
