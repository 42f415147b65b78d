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
See ``docs/integrations/lightning.md``.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallel
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn import Module
from torch.optim import Optimizer

import dcp_volumes
from dcp_volumes import catalog, errors
from dcp_volumes.backends import StoreLocation, redact_url
from dcp_volumes.checkpointer import Checkpointer
from dcp_volumes.integrations._full_state import load_full_state

__all__ = [
    "META_KEY",
    "VolumeCheckpointIO",
    "VolumeFabricModelParallelStrategy",
    "VolumeModelParallelStrategy",
    "latest_checkpoint",
]

logger = logging.getLogger(__name__)

#: the DCP item that holds what Lightning keeps in ``meta.pt`` (``torch.save`` bytes)
META_KEY = "lightning_meta"
#: the directory name of checkpoint ``step`` under the run root
STEP_FORMAT = "step-{step:08d}"


def _meta_bytes(meta: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(meta), buf)
    return buf.getvalue()


def _meta_from(blob: Any, weights_only: bool | None, where: str,
               safe_globals: Sequence[Any]) -> dict[str, Any]:
    """Lightning's metadata back from the stored bytes (untrusted: ``weights_only`` unless
    the caller passed ``weights_only=False``, as for Lightning's own ``meta.pt``; the
    classes in ``safe_globals`` allowed, as for every other item)."""
    if not isinstance(blob, (bytes, bytearray)) or not blob:
        raise errors.ConfigError(
            f"{where} has no {META_KEY!r} item: it was not saved by this integration; load it "
            "with dcp_volumes.VolumeReader directly")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            meta = torch.load(io.BytesIO(bytes(blob)), weights_only=weights_only is not False,
                              map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise errors.UnsafeCheckpointError(
            f"{where}: Lightning's metadata (hyperparameters, callback or loop state) "
            "references a class that is not allowed: pass it in safe_globals=[...] to the "
            f"strategy or VolumeCheckpointIO ({exc})") from exc
    if not isinstance(meta, dict):
        raise errors.UnsafeCheckpointError(f"{where}: {META_KEY!r} is not a dict")
    return meta


def latest_checkpoint(root: str | os.PathLike[str], *,
                      storage_options: dict[str, Any] | None = None) -> str | None:
    """The URL of the newest complete checkpoint under ``root``, or ``None``: pass it as
    ``ckpt_path=`` (``None`` starts fresh). One listing (:func:`dcp_volumes.catalog.latest`):
    on rank 0 and broadcast when torch.distributed is initialized, else by this process."""
    info = catalog.latest(root, storage_options=storage_options)
    return info.url if info is not None else None


class _Volumes:
    """What both strategies share: the run's :class:`~dcp_volumes.Checkpointer` (made on first
    use, once the process group exists: it creates groups of its own), the step of a save,
    and one DCP load of model + optimizers + metadata."""

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None,
                 options: dict[str, Any]) -> None:
        if "step_format" in options or "every_steps" in options or "async_save" in options:
            raise errors.ConfigError(
                "step_format / every_steps / async_save are not options of the Lightning "
                "strategies: ModelCheckpoint (or your Fabric loop) decides when to save, "
                "and saves are synchronous")
        self.root = os.fspath(root).rstrip("/")
        self.storage_options = StoreLocation.parse(self.root, storage_options).options
        catalog.check_count("keep_last", options.get("keep_last"))
        catalog.check_count("keep_every", options.get("keep_every"))
        self.options = options
        # made on first use: the Checkpointer creates process groups (every rank, once)
        self._checkpointer: Checkpointer | None = None
        #: what resume_path() returned last: loading it falls back past damaged checkpoints
        self.found: str | None = None
        #: the step this process saved last (a second save of it is skipped)
        self.last_step: int | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.root, storage_options=self.storage_options,
                                              step_format=STEP_FORMAT, **self.options)
        return self._checkpointer

    def url_for(self, step: int) -> str:
        return f"{self.root}/{STEP_FORMAT.format(step=step)}"

    def save(self, step: int, state: dict[str, Any], meta: Mapping[str, Any]) -> bool:
        """Save ``state`` + ``meta`` as checkpoint ``step`` (every rank). A second save of the
        step this process saved last (``ModelCheckpoint``'s top-k and ``last`` at the same
        step) is skipped: the state is the same."""
        if step == self.last_step:
            logger.info("checkpoint of step %d already saved: not saved again", step)
            return False
        state[META_KEY] = _meta_bytes(meta)
        self.checkpointer.save(step, state, force=True)
        self.last_step = step
        return True

    def resume_path(self) -> str | None:
        self.found = latest_checkpoint(self.root, storage_options=self.storage_options)
        return self.found

    def target(self, path: Any, broadcast: Callable[[Any], Any]) -> tuple[str, bool]:
        """The URL every rank loads (rank 0's) and whether it is what :meth:`resume_path`
        found (then a damaged checkpoint there is skipped for the next older one)."""
        url = os.fspath(path)
        url, newest = broadcast((url, url == self.found))
        return os.fspath(url), bool(newest)

    def load(self, url: str, module: Module, module_key: str,
             optimizers: Mapping[str, Optimizer], *, strict: bool,
             weights_only: bool | None, newest: bool = False) -> dict[str, Any]:
        """Load model and optimizer shards into ``module`` / ``optimizers`` (resharding as DCP
        does) and return Lightning's metadata, in one ``dcp.load``. ``newest``: ``url`` is
        what :meth:`resume_path` found; load the newest complete checkpoint whose data
        verifies instead (the Checkpointer's resume loop: a damaged one is skipped with a
        WARNING, and the run's next save of its step replaces it)."""
        state: dict[str, Any] = {module_key: get_model_state_dict(module)}
        for key, optim in optimizers.items():
            state[key] = get_optimizer_state_dict(module, optim)
        state[META_KEY] = b""
        ckpt = self.checkpointer
        if newest:
            step = ckpt.load_latest(state)
            if step is None:
                raise errors.CheckpointNotFoundError(
                    f"{redact_url(url)} is gone: no complete checkpoint under "
                    f"{redact_url(self.root)}; call resume_path() again")
            url = self.url_for(step)
        else:
            dcp_volumes.load(state, url, storage_options=self.storage_options,
                             transfer=ckpt.transfer, retry=ckpt.retry,
                             safe_globals=ckpt.safe_globals)
        set_model_state_dict(module, state[module_key], options=StateDictOptions(strict=strict))
        for key, optim in optimizers.items():
            set_optimizer_state_dict(module, optim, optim_state_dict=state[key],
                                     options=StateDictOptions(cpu_offload=True))
        self.last_step = None
        logger.info("resumed from %s", redact_url(url))
        return _meta_from(state[META_KEY], weights_only, redact_url(url), ckpt.safe_globals)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


def _options(keep_last: int | None, keep_every: int | None, overwrite: bool,
             extra: dict[str, Any]) -> dict[str, Any]:
    return {"keep_last": keep_last, "keep_every": keep_every, "overwrite": overwrite, **extra}


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

    volumes: _Volumes

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
        self.volumes = _Volumes(root, storage_options,
                                _options(keep_last, keep_every, overwrite, options))

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
        self.volumes = _Volumes(root, storage_options,
                                _options(keep_last, keep_every, overwrite, options))

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


class VolumeCheckpointIO(CheckpointIO):
    """A ``CheckpointIO`` for full (not sharded) checkpoints: DDP and single-device runs,
    where Lightning calls it on rank 0 only. Checkpoint ``N`` goes to ``{root}/step-N``
    through a :class:`~dcp_volumes.Checkpointer` of this process alone (tensors as DCP items,
    the rest as one ``torch.save`` item; retention after each commit); the path Lightning
    passes only says that a save is due.

    Pass it as ``Trainer(plugins=[VolumeCheckpointIO(root, ...)])`` and resume with
    ``ckpt_path=io.resume_path()``. ``**options`` are the Checkpointer's ``spool``,
    ``transfer``, ``retry``, ``run_id``.
    """

    def __init__(self, root: str | os.PathLike[str], /, *,
                 storage_options: dict[str, Any] | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, overwrite: bool = False,
                 safe_globals: Sequence[Any] = (), **options: Any) -> None:
        self.volumes = _Volumes(root, storage_options, _options(
            keep_last, keep_every, overwrite,
            {"safe_globals": tuple(safe_globals), "alone": True, **options}))

    def url_for(self, step: int) -> str:
        return self.volumes.url_for(step)

    def resume_path(self) -> str | None:
        """The newest complete checkpoint under ``root`` (one listing by this process)."""
        info = catalog.latest(self.volumes.root, storage_options=self.volumes.storage_options,
                              broadcast=False)
        return info.url if info is not None else None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("pass storage_options to VolumeCheckpointIO(...)")
        rest = {k: x for k, x in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state: dict[str, Any] = {"state_dict": checkpoint.get("state_dict", {}),
                                 "optimizer_states": list(checkpoint.get("optimizer_states", []))}
        self.volumes.save(int(checkpoint.get("global_step", 0)), state, rest)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # the state is rebuilt from .metadata (dcp.load would load into given keys only);
        # every rank that calls this loads it all (DDP: each rank, as Lightning does)
        url = os.fspath(path)
        ckpt = self.volumes.checkpointer
        state = load_full_state(url, storage_options=self.volumes.storage_options,
                                transfer=ckpt.transfer, retry=ckpt.retry,
                                safe_globals=ckpt.safe_globals)
        checkpoint = _meta_from(state.pop(META_KEY, None), weights_only, redact_url(url),
                                ckpt.safe_globals)
        checkpoint["state_dict"] = state.get("state_dict", {})
        checkpoint["optimizer_states"] = [_param_ids(o) for o in
                                          _as_list(state.get("optimizer_states", []))]
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Nothing: what is kept is ``keep_last`` / ``keep_every`` (applied after each save)."""
        logger.debug("asked to remove %s: retention is keep_last/keep_every", path)

    def teardown(self) -> None:
        self.volumes.close()


def _param_ids(optim_state: Any) -> Any:
    """DCP stores the keys of ``optimizer.state_dict()["state"]`` (parameter ids) as strings;
    ``Optimizer.load_state_dict`` matches them as ints."""
    if isinstance(optim_state, dict) and isinstance(optim_state.get("state"), dict):
        optim_state["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                                for k, v in optim_state["state"].items()}
    return optim_state


def _as_list(value: Any) -> list[Any]:
    """DCP's empty-state-dict planner rebuilds a saved list as a list or as a dict keyed by
    index; Lightning wants the list."""
    if isinstance(value, dict):
        return [value[k] for k in sorted(value, key=int)]
    return list(value)
