"""dcp_volumes: fast, safe PyTorch Distributed Checkpoint (DCP) storage on object stores.

Pass a :class:`VolumeWriter` as ``storage_writer=`` to ``dcp.save``/``dcp.async_save`` and a
:class:`VolumeReader` as ``storage_reader=`` to ``dcp.load``, with any fsspec URL; a training
loop can hold one :class:`Checkpointer` instead.

The public names are resolved lazily (module ``__getattr__``): importing the package does not
import torch, so the ``dcp-volumes`` command starts fast and ``ls``/``latest``/``gc`` never pay
for torch. ``from dcp_volumes import VolumeWriter`` works as usual.

The error hierarchy (:mod:`dcp_volumes.errors`, rooted at :class:`DCPVolumesError`) is
imported eagerly and re-exported here (``except dcp_volumes.CheckpointNotFoundError``): it
imports nothing itself, so it costs ``import dcp_volumes`` about a millisecond.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dcp_volumes import errors
from dcp_volumes._version import __version__
from dcp_volumes.errors import (
    BucketNotFoundError,
    CheckpointChangedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    DCPVolumesError,
    DeleteError,
    DestinationMismatchError,
    DownloadError,
    ExportConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    ObjectNotFoundError,
    RangeMismatchError,
    RootInUseError,
    ShortBodyError,
    SpoolError,
    StoragePermissionError,
    UnsafeCheckpointError,
    UnsupportedTransformError,
    UploadError,
)

if TYPE_CHECKING:
    from dcp_volumes._api import load, save
    from dcp_volumes.checkpointer import Checkpointer
    from dcp_volumes.config import LocalTierOptions, RetryOptions, SpoolOptions, TransferOptions
    from dcp_volumes.export import ExportReport, SafetensorsReader, export_safetensors
    from dcp_volumes.reader import VolumeReader
    from dcp_volumes.saving import release_staging_buffers
    from dcp_volumes.stats import LoadStats, SaveStats
    from dcp_volumes.writer import VolumeWriter

__all__ = [
    "BucketNotFoundError",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ConfigError",
    "DCPVolumesError",
    "DeleteError",
    "DestinationMismatchError",
    "DownloadError",
    "ExportConflictError",
    "ExportReport",
    "IncompleteCheckpointError",
    "IntegrityError",
    "LoadStats",
    "LocalTierOptions",
    "ObjectNotFoundError",
    "RangeMismatchError",
    "RetryOptions",
    "RootInUseError",
    "SafetensorsReader",
    "SaveStats",
    "ShortBodyError",
    "SpoolError",
    "SpoolOptions",
    "StoragePermissionError",
    "TransferOptions",
    "UnsafeCheckpointError",
    "UnsupportedTransformError",
    "UploadError",
    "VolumeReader",
    "VolumeWriter",
    "__version__",
    "errors",
    "export_safetensors",
    "load",
    "release_staging_buffers",
    "save",
]

# Public name → module that defines it. Only these are resolved lazily.
_LAZY: dict[str, str] = {
    "VolumeWriter": "dcp_volumes.writer",
    "VolumeReader": "dcp_volumes.reader",
    "SafetensorsReader": "dcp_volumes.export",
    "Checkpointer": "dcp_volumes.checkpointer",
    "SpoolOptions": "dcp_volumes.config",
    "LocalTierOptions": "dcp_volumes.config",
    "TransferOptions": "dcp_volumes.config",
    "RetryOptions": "dcp_volumes.config",
    "SaveStats": "dcp_volumes.stats",
    "LoadStats": "dcp_volumes.stats",
    "export_safetensors": "dcp_volumes.export",
    "ExportReport": "dcp_volumes.export",
    "save": "dcp_volumes._api",
    "load": "dcp_volumes._api",
    "release_staging_buffers": "dcp_volumes.saving._staging",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # AttributeError lets `from dcp_volumes import <submodule>` fall back to importing it.
        raise AttributeError(f"module 'dcp_volumes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
