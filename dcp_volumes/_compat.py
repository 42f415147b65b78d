"""The torch features dcp_volumes uses that not every supported torch release has.

dcp_volumes supports torch 2.8 through 2.14 (``pyproject.toml``; CI runs the core tests on both
ends with ``scripts/test_torch_versions.sh``). Everything that differs across that range is
detected here, from the API itself rather than from ``torch.__version__``, and the rest of the
package asks this module instead of probing torch on its own.

What differs (2.8 lacks it, 2.13 has it):

- ``AsyncSaveResponse``: ``async_save`` may return the staging and the upload futures apart
  (:func:`upload_future`);
- torch's own staging stack, ``async_save(async_stager=...)`` with ``DefaultStager`` /
  ``StagingOptions`` (:data:`HAS_ASYNC_STAGER_ARG`; VolumeWriter stages by itself through the
  ``AsyncStager`` protocol, which every release in the range has);
- ``rank=`` passed to ``set_up_storage_writer`` / ``set_up_storage_reader``
  (:func:`storage_rank`).

Every supported release has the rest; it is detected all the same, so that on a torch without
it dcp_volumes does without or fails with a message that names the feature: ``no_dist=`` on ``dcp.save`` / ``dcp.load``
(:data:`HAS_NO_DIST`, :func:`no_dist`), ``AsyncCheckpointerType`` with its PROCESS executor
(:data:`HAS_PROCESS_ASYNC_SAVE`, :func:`async_executor`), plan caching
(:data:`HAS_PLAN_CACHING`) and the zip CRC32 switch (:func:`zip_crc32_options`).

Why the floor is 2.8, not older: on 2.6 and 2.7, ``dist.destroy_process_group()`` can deadlock
after an object collective on a gloo group (see :data:`GLOO_TEARDOWN_MAY_DEADLOCK`). DCP's own
save and load use object collectives, and :class:`~dcp_volumes.Checkpointer` adds gloo groups
even to an NCCL job, so a training script that tears its groups down at exit could hang there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver as _saver
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_volumes import errors

__all__ = [
    "GLOO_TEARDOWN_MAY_DEADLOCK",
    "HAS_ASYNC_STAGER_ARG",
    "HAS_NO_DIST",
    "HAS_PLAN_CACHING",
    "HAS_PROCESS_ASYNC_SAVE",
    "TORCH_VERSION",
    "async_executor",
    "no_dist",
    "storage_rank",
    "upload_future",
    "zip_crc32_options",
]

TORCH_VERSION: str = torch.__version__


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (DCP's decorators keep ``__wrapped__``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


#: ``dcp.save`` and ``dcp.load`` take ``no_dist=True``: save or load in this process alone,
#: even inside an initialized process group.
HAS_NO_DIST: bool = _takes(dcp.save, "no_dist") and _takes(dcp.load, "no_dist")

_AsyncCheckpointerType: Any = getattr(_saver, "AsyncCheckpointerType", None)
_AsyncSaveResponse: Any = getattr(_saver, "AsyncSaveResponse", None)

#: ``dcp.async_save`` can run the upload in a separate process
#: (``async_checkpointer_type=AsyncCheckpointerType.PROCESS``), not only in a thread.
HAS_PROCESS_ASYNC_SAVE: bool = _AsyncCheckpointerType is not None and _takes(
    dcp.async_save, "async_checkpointer_type"
)

#: ``dcp.async_save`` takes ``async_stager=`` (torch's ``DefaultStager``, ``StagingOptions``).
HAS_ASYNC_STAGER_ARG: bool = _takes(dcp.async_save, "async_stager")

#: ``DefaultSavePlanner(enable_plan_caching=True)``: later saves reuse the first save's plans.
HAS_PLAN_CACHING: bool = _takes(DefaultSavePlanner.__init__, "enable_plan_caching")

#: ``dist.destroy_process_group()`` can hang forever with gloo: the group's destructor joins
#: its worker threads while holding the GIL, and a worker that still holds the last reference to
#: a tensor made in Python (a ``broadcast_object_list`` buffer) waits for the GIL to free it.
#: A bug, not a feature, so the only test is the release: fixed by pytorch/pytorch#154976
#: (June 2025, torch 2.8). Seen here on 2.6.0 and 2.7.1 within 3 to 19 init/broadcast/destroy
#: cycles of 2 ranks, every time; never in 300 cycles on 2.8.0, 2.13.0 or 2.14.1. Below the
#: supported range; kept so that ``dcp_volumes.testing.dist`` stays safe on such a torch.
GLOO_TEARDOWN_MAY_DEADLOCK: bool = tuple(
    int(x) for x in TORCH_VERSION.split("+")[0].split(".")[:2]
) < (2, 8)


def no_dist() -> dict[str, bool]:
    """Keyword arguments that make ``dcp.save`` / ``dcp.load`` run in this process alone.

    Use as ``dcp.save(state, storage_writer=w, **no_dist())``. Where torch has ``no_dist=``
    this is ``{"no_dist": True}``. Older torch has no such argument but saves alone by itself
    when no default process group exists, so nothing is passed.

    Raises:
        ConfigError: torch lacks ``no_dist=`` and a default process group is initialized, so
            the call would be a collective the caller did not ask for.
    """
    if HAS_NO_DIST:
        return {"no_dist": True}
    if dist.is_available() and dist.is_initialized():
        raise errors.ConfigError(
            f"torch {TORCH_VERSION} has no dcp.save(no_dist=True): inside a process group, "
            "save and load on all ranks (pass process_group=) or upgrade torch"
        )
    return {}


def async_executor(executor: str) -> dict[str, Any]:
    """Keyword arguments that make ``dcp.async_save`` upload in a ``"thread"`` or ``"process"``.

    Torch without ``AsyncCheckpointerType`` always uses a thread: ``"thread"`` gives ``{}``.

    Raises:
        ConfigError: ``executor`` is ``"process"`` and this torch has no process executor, or
            ``executor`` is neither.
    """
    if executor not in ("thread", "process"):
        raise errors.ConfigError(
            f"async_save executor must be 'thread' or 'process', got {executor!r}")
    if HAS_PROCESS_ASYNC_SAVE:
        return {"async_checkpointer_type": _AsyncCheckpointerType[executor.upper()]}
    if executor == "process":
        raise errors.ConfigError(
            f"torch {TORCH_VERSION} has no AsyncCheckpointerType.PROCESS for dcp.async_save: "
            "use the thread executor or upgrade torch"
        )
    return {}


def upload_future(response: Any) -> Future[Any]:
    """The future that settles when an ``async_save`` has committed its checkpoint.

    ``response`` is what ``dcp.async_save`` returned: a ``Future``, or on newer torch possibly
    an ``AsyncSaveResponse`` whose ``upload_completion`` is that future.
    """
    if _AsyncSaveResponse is not None and isinstance(response, _AsyncSaveResponse):
        return response.upload_completion  # type: ignore[no-any-return]
    return response  # type: ignore[no-any-return]


def storage_rank(kwargs: dict[str, Any]) -> int:
    """This rank's index in the save or load, from ``set_up_storage_writer/reader``'s kwargs.

    Newer torch passes ``rank=``; older torch passes nothing, so ask the default process group
    (0 outside one).
    """
    rank = kwargs.get("rank")
    if rank is not None:
        return int(rank)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def zip_crc32_options() -> tuple[Callable[[], bool], Callable[[bool], None]] | None:
    """``torch.serialization``'s get/set of the zip CRC32 that ``torch.save`` computes, or
    ``None`` where this torch cannot turn it off."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        return None
    return get, set_
