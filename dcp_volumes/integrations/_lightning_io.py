"""``VolumeCheckpointIO``: Lightning's ``CheckpointIO`` for full (not sharded) state dicts
(DDP, single device), saved by rank 0 through a Checkpointer of its own process. See
:mod:`dcp_volumes.integrations.lightning`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from dcp_volumes import catalog
from dcp_volumes.backends import redact_url
from dcp_volumes.integrations._full_state import load_full_state
from dcp_volumes.integrations._lightning_volumes import (
    META_KEY,
    Volumes,
    checkpoint_options,
    meta_from,
)

__all__ = ["VolumeCheckpointIO"]

# the public module's logger: what users filter on stays one name
logger = logging.getLogger("dcp_volumes.integrations.lightning")


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
        self.volumes = Volumes(root, storage_options, checkpoint_options(
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
        checkpoint = meta_from(state.pop(META_KEY, None), weights_only, redact_url(url),
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
    ``Optimizer.load_state_dict`` matches them as ints. An empty ``"state"`` (SGD without
    momentum, any optimizer before its first step) is not stored at all (DCP keeps no empty
    containers), and ``load_state_dict`` needs the key: it comes back empty."""
    if isinstance(optim_state, dict) and "param_groups" in optim_state:
        optim_state.setdefault("state", {})
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
