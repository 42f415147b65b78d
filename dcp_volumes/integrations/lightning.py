"""Lightning (``lightning`` 2.x): sharded checkpoints of ``ModelParallelStrategy`` (FSDP2 /
tensor parallel), in the Trainer and in Fabric, and full checkpoints of DDP / single-device
runs, saved to and resumed from any fsspec URL through dcp_volumes.

Lightning saves a sharded checkpoint with ``torch.distributed.checkpoint.save(state,
checkpoint_id=path)`` to a local directory, then writes ``meta.pt`` (loops, callbacks,
epoch, ...) from rank 0; it does not route that save through ``CheckpointIO``. Here:

* :class:`VolumeModelParallelStrategy` (Trainer) and :class:`VolumeFabricModelParallelStrategy`
  (Fabric) override ``save_checkpoint`` / ``load_checkpoint``. A save goes through a
  :class:`~dcp_volumes.Checkpointer` (``VolumeWriter``, retention after the commit). What
  Lightning keeps in ``meta.pt`` travels *inside* the DCP state as one bytes item
  (``"lightning_meta"``, ``torch.save`` bytes), so it is committed by the same ``.metadata``:
  a checkpoint is never listed as resumable before everything Lightning needs is durable.
* :class:`VolumeCheckpointIO` is a ``CheckpointIO`` for full state dicts (DDP, single device):
  rank 0 saves through a :class:`~dcp_volumes.Checkpointer` of its own process
  (``alone=True``), in the same layout.
* :func:`latest_checkpoint` / ``strategy.resume_path()``: the newest complete checkpoint under
  the run root, found by one listing (:func:`dcp_volumes.catalog.latest`), for
  ``trainer.fit(..., ckpt_path=...)`` or ``fabric.load(...)``.

Checkpoint ``N`` (Lightning's ``global_step``, Fabric's own step) lives at
``f"{root}/step-{N:08d}"``, so ``dcp-volumes ls/latest/gc`` work on the run. ``ModelCheckpoint``
still decides *when* to save; the path it computes is not used (only the step), and its
``save_top_k`` removals are ignored: retention is ``keep_last`` / ``keep_every`` here.

This module imports Lightning at its top; ``import dcp_volumes`` never imports it.
Modules: ``lightning`` (the strategies), ``_lightning_volumes`` (what all three share: the
run root, the metadata item, one load), ``_lightning_io`` (``VolumeCheckpointIO``).
See ``docs/integrations/lightning.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallel
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.nn import Module
from torch.optim import Optimizer

from dcp_volumes import catalog, errors
from dcp_volumes.backends import redact_url
from dcp_volumes.integrations._lightning_io import VolumeCheckpointIO
from dcp_volumes.integrations._lightning_volumes import (
    META_KEY,
    STEP_FORMAT,
    Volumes,
    checkpoint_options,
    latest_checkpoint,
)

__all__ = [
    "META_KEY",
    "STEP_FORMAT",
    "VolumeCheckpointIO",
    "VolumeFabricModelParallelStrategy",
    "VolumeModelParallelStrategy",
    "latest_checkpoint",
]

logger = logging.getLogger(__name__)


def _broadcast_str(value: Any, broadcast: Callable[[Any], Any]) -> str:
    # every rank loads what rank 0 named (as Lightning's own load_checkpoint does)
    return os.fspath(broadcast(os.fspath(value)))


#: ``ModelParallelStrategy``'s own arguments, passed through by the strategies below
_STRATEGY_ARGS = ("data_parallel_size", "tensor_parallel_size", "process_group_backend",
                  "timeout")


def _strategy_args(options: dict[str, Any]) -> dict[str, Any]:
    """Take ``ModelParallelStrategy``'s own arguments out of ``options``."""
    if "save_distributed_checkpoint" in options:
        raise errors.ConfigError("save_distributed_checkpoint is always True here")
    return {k: options.pop(k) for k in list(options) if k in _STRATEGY_ARGS}


class _Located:
    """Where a strategy's checkpoints are: ``url_for(step)`` and ``resume_path()``."""

    volumes: Volumes

    def url_for(self, step: int) -> str:
        """The URL checkpoint ``step`` is saved to (Trainer: ``global_step``; Fabric: the
        path to pass to ``fabric.save``)."""
        return self.volumes.url_for(step)

    def resume_path(self) -> str | None:
        """The newest complete checkpoint under ``root`` (one listing on rank 0, broadcast
        once a process group exists), for ``ckpt_path=`` / ``fabric.load``."""
        return self.volumes.resume_path()


class VolumeModelParallelStrategy(_Located, _TrainerModelParallel):
    """``lightning.pytorch.strategies.ModelParallelStrategy`` whose sharded checkpoints go to
    ``root`` through dcp_volumes.

    Args:
        root: the run root, e.g. ``"s3://bucket/run-42"`` (any fsspec URL or local path).
        storage_options: passed to fsspec unchanged; never logged.
        keep_last / keep_every: retention after each commit (as the Checkpointer's).
        overwrite: replace a complete checkpoint already at a step's URL.
        **options: the :class:`~dcp_volumes.Checkpointer`'s ``spool``, ``transfer``, ``retry``
            and ``safe_globals``; and ``ModelParallelStrategy``'s own
            (``data_parallel_size``, ``tensor_parallel_size``, ``process_group_backend``,
            ``timeout``).

    Use ``ckpt_path=strategy.resume_path()`` to resume from the newest complete checkpoint.
    ``save_distributed_checkpoint=False`` (one full file on rank 0) is not supported.
    """

    def __init__(self, root: str | os.PathLike[str], /, *,
                 storage_options: dict[str, Any] | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, overwrite: bool = False,
                 **options: Any) -> None:
        super().__init__(**_strategy_args(options))
        self.volumes = Volumes(root, storage_options,
                               checkpoint_options(keep_last, keep_every, overwrite, options))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Save the Trainer's checkpoint as step ``checkpoint["global_step"]`` under ``root``
        (``filepath``, from ModelCheckpoint, only says that a save is due)."""
        if storage_options is not None:
            raise TypeError("save_checkpoint(..., storage_options=...) is not supported: pass "
                            "storage_options to VolumeModelParallelStrategy(...)")
        step = int(checkpoint["global_step"])
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = optim_state
        if self.volumes.save(step, state, checkpoint):
            logger.debug("ModelCheckpoint asked for %s; saved %s", filepath,
                         redact_url(self.url_for(step)))

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved by :meth:`save_checkpoint` (a URL) into the model and
        optimizers; return what Lightning restores the rest from. The URL
        :meth:`resume_path` returned resumes from the newest checkpoint that verifies."""
        url, newest = self.volumes.target(checkpoint_path, self.broadcast)
        assert self.lightning_module is not None and self.model is not None
        optimizers = {f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}
        return self.volumes.load(url, self.model, "state_dict", optimizers,
                                 strict=self.lightning_module.strict_loading,
                                 weights_only=weights_only, newest=newest)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Nothing: what is kept is ``keep_last`` / ``keep_every`` (applied after each save)."""
        logger.debug("ModelCheckpoint asked to remove %s: retention is keep_last/keep_every",
                     filepath)

    def teardown(self) -> None:
        self.volumes.close()
        super().teardown()


class VolumeFabricModelParallelStrategy(_Located, _FabricModelParallel):
    """``lightning.fabric.strategies.ModelParallelStrategy`` whose checkpoints go to ``root``
    through dcp_volumes: ``fabric.save(strategy.url_for(step), state)`` and
    ``fabric.load(strategy.resume_path(), state)``. ``parallelize_fn`` as Lightning's; the
    other arguments as :class:`VolumeModelParallelStrategy`'s."""

    def __init__(self, root: str | os.PathLike[str], /,
                 parallelize_fn: Callable[[Any, Any], Any], *,
                 storage_options: dict[str, Any] | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, overwrite: bool = False,
                 **options: Any) -> None:
        super().__init__(parallelize_fn, **_strategy_args(options))
        self.volumes = Volumes(root, storage_options,
                               checkpoint_options(keep_last, keep_every, overwrite, options))

    def _step_of(self, path: Any) -> int:
        url = os.fspath(path).rstrip("/")
        name = url[len(self.volumes.root) + 1:] if url.startswith(self.volumes.root + "/") else ""
        step = catalog.step_of(name, catalog.compile_step_pattern(None))
        if step is None or self.url_for(step) != url:
            raise errors.ConfigError(
                f"{redact_url(url)} is not a checkpoint URL of this run: save to "
                "strategy.url_for(step)")
        return step

    def save_checkpoint(self, path: Any, state: dict[str, Any],
                        storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Save modules and optimizers as shards and the rest of ``state`` as Lightning's
        metadata, as checkpoint ``step`` of ``path`` (from :meth:`url_for`)."""
        if storage_options is not None or filter is not None:
            raise TypeError("storage_options= and filter= are not supported: pass "
                            "storage_options to the strategy; filtered sharded checkpoints "
                            "cannot be loaded (as in Lightning)")
        step = self._step_of(_broadcast_str(path, self.broadcast))
        module = _one_module(state)
        opts = StateDictOptions(cpu_offload=True)
        shards: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                shards[key] = get_model_state_dict(obj, options=opts)
            elif isinstance(obj, Optimizer):
                shards[key] = get_optimizer_state_dict(module, obj, options=opts)
            else:
                meta[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        self.volumes.save(step, shards, meta)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved by :meth:`save_checkpoint` into ``state`` (modules and
        optimizers in place, other keys replaced); return the metadata not asked for.

        ``path`` ``None`` (what :meth:`resume_path` returns when nothing is stored yet) loads
        nothing and returns ``{}``: ``fabric.load(strategy.resume_path(), state)`` is the
        same line on a first run and on a resume. The URL :meth:`resume_path` returned
        resumes from the newest checkpoint that verifies (a damaged one is skipped)."""
        if path is None:
            logger.info("no checkpoint to resume from: starting fresh")
            return {}
        if not isinstance(state, dict) or not state:
            raise TypeError("fabric.load(path, state) needs a dict state holding the model")
        url, newest = self.volumes.target(path, self.broadcast)
        module = _one_module(state)
        key = next(k for k, v in state.items() if v is module)
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        meta = self.volumes.load(url, module, key, optimizers, strict=strict,
                                 weights_only=weights_only, newest=newest)
        wanted = state.keys() - {key} - optimizers.keys()
        missing = sorted(k for k in wanted if k not in meta)
        if strict and missing:
            raise KeyError(f"{redact_url(url)} holds no {missing}; load with strict=False")
        for k in wanted:
            if k in meta:
                state[k] = meta.pop(k)
        return meta

    def teardown(self) -> None:
        self.volumes.close()
        super().teardown()


def _one_module(state: Mapping[str, Any]) -> Module:
    modules = [v for v in state.values() if isinstance(v, Module)]
    if len(modules) != 1:
        raise ValueError(f"a sharded checkpoint holds exactly one model; got {len(modules)}: "
                         "save each model to its own run root")
    return modules[0]
