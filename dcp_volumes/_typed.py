"""Getting a reader's typed error through ``dcp.load``'s metadata step.

Since torch 2.9, ``dcp.load`` catches whatever ``read_metadata()`` raises, asks
``read_metadata(rank=...)`` for per-rank metadata instead and, when that fails too, raises a
bare ``AssertionError`` that carries only the two messages: the typed error is lost (older
torch wraps it in ``CheckpointException`` as it is). What torch does carry is an exception
raised later in the same step, from ``set_up_storage_reader``: it reaches the caller inside
``CheckpointException.failures``, the exception object itself.

So a reader whose ``read_metadata()`` failed answers the per-rank call with
:func:`deferred` (an empty ``Metadata`` holding the error), and its
``set_up_storage_reader`` calls :func:`raise_deferred`, which raises the recorded error.
``dcp_volumes.load`` then re-raises it unwrapped.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata

from dcp_volumes import errors

__all__ = ["deferred", "raise_deferred"]


@dataclass(frozen=True)
class _Deferred:
    error: errors.DCPVolumesError


def deferred(error: errors.DCPVolumesError) -> Metadata:
    """An empty ``Metadata`` that makes :func:`raise_deferred` raise ``error``."""
    return Metadata(state_dict_metadata={}, planner_data=_Deferred(error))


def raise_deferred(metadata: Metadata) -> None:
    """Raise the error :func:`deferred` put in ``metadata``, if it holds one."""
    held = getattr(metadata, "planner_data", None)
    if isinstance(held, _Deferred):
        raise held.error
