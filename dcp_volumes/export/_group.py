"""The ranks of one export: rank 0's token for all, and a step every rank reports to (a
failure on any rank fails every rank, typed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dcp_volumes import _dist, errors
from dcp_volumes.export._dest import new_token

__all__ = ["PEER_TIMEOUT_S", "Group", "attempt"]

#: the longest a rank waits for the others at one step (they may be writing big files)
PEER_TIMEOUT_S = 3600.0


class Group:
    """The ranks of one export (one rank without ``torch.distributed``)."""

    def __init__(self, task: str) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.group = 0, 1, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.group = _dist.cpu_group("gloo" not in str(dist.get_backend()))
        self.task = task

    def token(self) -> str:
        """The export's token: rank 0's, sent to every rank."""
        return str(_dist.from_rank0(new_token, self.group, self.world > 1))

    def from_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its answer (or its error, raised) on every rank."""
        return _dist.from_rank0(fn, self.group, self.world > 1)

    def step(self, err: BaseException | None, step: str) -> None:
        """Every rank reports; if any failed, every rank raises (its own error, or the
        failing rank's, typed)."""
        if self.world == 1:
            if err is not None:
                raise err
            return
        _dist.agree(err, group=self.group, world=self.world, me=self.rank,
                    timeout_s=PEER_TIMEOUT_S, task=self.task, step=step,
                    error=errors.UploadError)


def attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 — reported to every rank by Group.step
        return None, exc
