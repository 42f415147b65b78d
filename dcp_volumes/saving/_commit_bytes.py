"""What commits a save, as bytes: the integrity manifest of every rank's write results and
the ``.metadata`` (the standard pickled torch ``Metadata``, plain ``_StorageInfo`` entries,
carrying the save id), built once on the coordinator for the store or the local tier."""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes._manifest import Manifest, manifest_of, paused_gc
from dcp_volumes._metadata import set_save_id
from dcp_volumes._version import __version__

__all__ = ["commit_bytes"]


def commit_bytes(metadata: Metadata, results: list[list[WriteResult]], *, save_id: str,
                 url: str) -> tuple[Manifest, bytes]:
    """The manifest of ``results`` and the pickled ``metadata`` (its ``storage_data`` set
    from ``results``, the save id recorded) of the save ``save_id`` to ``url``."""
    with paused_gc():  # a million items: see paused_gc
        manifest = manifest_of(save_id, f"dcp_volumes {__version__}", results)
        metadata.storage_data = {wr.index: _plain_storage_info(wr.storage_data)
                                 for rank_results in results for wr in rank_results}
        set_save_id(metadata, save_id, url)
        return manifest, pickle.dumps(metadata)


def _plain_storage_info(info: Any) -> _StorageInfo:
    """What ``.metadata`` records for an item: a plain ``_StorageInfo`` (reused as is when it
    is one: a million items at rank 0 make the copy cost a second)."""
    if type(info) is _StorageInfo:
        return info
    return _StorageInfo(info.relative_path, info.offset, info.length)
