"""dcp_volumes: fast, safe PyTorch Distributed Checkpoint (DCP) storage on object stores.

Pass a :class:`VolumeWriter` as ``storage_writer=`` to ``dcp.save``/``dcp.async_save`` and a
:class:`VolumeReader` as ``storage_reader=`` to ``dcp.load``, with any fsspec URL.
"""

from __future__ import annotations

from dcp_volumes._stats import LoadStats, SaveStats
from dcp_volumes._version import __version__
from dcp_volumes.config import RetryOptions, SpoolOptions, TransferOptions
from dcp_volumes.reader import VolumeReader
from dcp_volumes.writer import VolumeWriter

__all__ = [
    "VolumeWriter",
    "VolumeReader",
    "SpoolOptions",
    "TransferOptions",
    "RetryOptions",
    "SaveStats",
    "LoadStats",
    "__version__",
]
