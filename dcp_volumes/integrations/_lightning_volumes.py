"""What Lightning's strategies and ``VolumeCheckpointIO`` share: the run root, Lightning's
metadata as one DCP item, the :class:`~dcp_volumes.Checkpointer` of the run, and one load
of model + optimizers + metadata (:class:`Volumes`). See :mod:`dcp_volumes.integrations.lightning`.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
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
from dcp_volumes.backends import StoreLocation, open_backend, redact_url
from dcp_volumes.checkpointer import Checkpointer

__all__ = ["META_KEY", "STEP_FORMAT", "Volumes", "checkpoint_options", "latest_checkpoint",
           "meta_from"]

# the public module's logger: what users filter on stays one name
logger = logging.getLogger("dcp_volumes.integrations.lightning")

#: the DCP item that holds what Lightning keeps in ``meta.pt`` (``torch.save`` bytes)
META_KEY = "lightning_meta"
#: the directory name of checkpoint ``step`` under the run root
STEP_FORMAT = "step-{step:08d}"


def meta_bytes(meta: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(meta), buf)
    return buf.getvalue()


def meta_from(blob: Any, weights_only: bool | None, where: str,
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
        raise _refused(bytes(blob), where, safe_globals) from exc
    if not isinstance(meta, dict):
        raise errors.UnsafeCheckpointError(f"{where}: {META_KEY!r} is not a dict")
    return meta


def _refused(blob: bytes, where: str, safe_globals: Sequence[Any]
             ) -> errors.UnsafeCheckpointError:
    """The refusal of Lightning's metadata by the weights-only unpickler, naming what it
    references that is not allowed (``save_hyperparameters()`` of an ``argparse.Namespace``
    or of a dataclass, say) and the two ways to allow it."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
    except Exception:  # noqa: BLE001 — naming them is a courtesy; the refusal stands
        names = []
    given = {f"{getattr(g, '__module__', '?')}.{getattr(g, '__qualname__', g)}"
             for g in safe_globals}
    shown = sorted(set(names) - given)
    what = (f"references {', '.join(shown[:5])}" if shown
            else "holds a value (a class, function or opcode)")
    return errors.UnsafeCheckpointError(
        f"{where}: Lightning's metadata (hyperparameters, callback or loop state) {what}, "
        "which torch's weights-only unpickler does not allow: pass "
        f"{('it' if len(shown) == 1 else 'them') if shown else 'its classes'} in "
        "safe_globals=[...] to the strategy or VolumeCheckpointIO, or, if you trust this "
        "checkpoint, weights_only=False to trainer.fit or fabric.load")


def latest_checkpoint(root: str | os.PathLike[str], *,
                      storage_options: dict[str, Any] | None = None) -> str | None:
    """The URL of the newest complete checkpoint under ``root``, or ``None``: pass it as
    ``ckpt_path=`` (``None`` starts fresh). One listing (:func:`dcp_volumes.catalog.latest`):
    on rank 0 and broadcast when torch.distributed is initialized, else by this process."""
    info = catalog.latest(root, storage_options=storage_options)
    return info.url if info is not None else None


class Volumes:
    """What both strategies share: the run's :class:`~dcp_volumes.Checkpointer` (made on first
    use, once the process group exists: it creates groups of its own), the step of a save,
    and one DCP load of model + optimizers + metadata.

    Raises:
        BucketNotFoundError: the bucket or container of ``root`` does not exist (checked at
            construction, by each process that makes one).
        StoragePermissionError: the store refused the credentials.
    """

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
        # the Checkpointer is made at the first save, an epoch of training from now: a
        # missing bucket or refused credentials fail here instead (one request)
        backend = open_backend(self.root, self.storage_options, options.get("retry"))
        backend.run(backend.check_bucket)
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
        state[META_KEY] = meta_bytes(meta)
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
        return meta_from(state[META_KEY], weights_only, redact_url(url), ckpt.safe_globals)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


def checkpoint_options(keep_last: int | None, keep_every: int | None, overwrite: bool,
             extra: dict[str, Any]) -> dict[str, Any]:
    return {"keep_last": keep_last, "keep_every": keep_every, "overwrite": overwrite, **extra}
