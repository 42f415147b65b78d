"""A whole checkpoint as the nested state it was saved from, in this process alone: what a
framework that reads full (not sharded) checkpoints on one rank needs (Lightning's
``CheckpointIO``), through public DCP calls only.

The target is built from the checkpoint's ``.metadata`` (an empty tensor per stored tensor, a
placeholder per pickled item), loaded by :func:`dcp_volumes.load` (``no_dist``; typed
errors; every item's checksum verified), and nested back along ``.metadata``'s own paths.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import dcp_volumes
from dcp_volumes import errors
from dcp_volumes.config import RetryOptions, TransferOptions
from dcp_volumes.reader import VolumeReader

__all__ = ["load_full_state"]


def _target(metadata: Metadata) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[fqn] = None  # a pickled item: DCP replaces it with what was stored
    return state


def _slot(node: Any, key: Any) -> Any:
    """``node[key]`` or None, growing a list to hold index ``key``."""
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        return node[key]
    return node.get(key)


def _put(root: dict[str, Any], path: tuple[Any, ...], value: Any, where: str) -> None:
    """``root[path[0]][path[1]]... = value``, making a list where the next key is an index
    and a dict where it is a name (as DCP flattened them)."""
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        kind = list if isinstance(nxt, int) else dict
        child = _slot(node, key)
        if child is None:
            child = node[key] = kind()
        if not isinstance(child, kind):
            raise errors.IntegrityError(f"{where}: stored paths of two items collide")
        node = child
    _slot(node, path[-1])
    node[path[-1]] = value


def _nested(flat: dict[str, Any], paths: Any, where: str) -> dict[str, Any]:
    """``flat`` nested back along ``paths`` (``.metadata``'s planner data: key -> the path
    of names and list indices it was flattened from; untrusted, so checked: an index is
    below the number of items, a path starts with a name)."""
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,)) if isinstance(paths, dict) else (fqn,)
        if (not isinstance(path, (tuple, list)) or not path or not isinstance(path[0], str)
                or not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(
                    p, bool) and 0 <= p < len(flat)) for p in path)):
            raise errors.IntegrityError(f"{where}: the stored path of {fqn!r} is not a path")
        _put(out, tuple(path), value, where)
    return out


def load_full_state(url: str, *, storage_options: dict[str, Any] | None = None,
                    transfer: TransferOptions | None = None, retry: RetryOptions | None = None,
                    safe_globals: Sequence[Any] = ()) -> dict[str, Any]:
    """Everything checkpoint ``url`` holds, nested as saved, loaded by this process alone.

    Raises:
        DCPVolumesError: as :func:`dcp_volumes.load` (typed).
    """
    reader = VolumeReader(url, storage_options=storage_options, transfer=transfer,
                          retry=retry, safe_globals=safe_globals)
    metadata = reader.read_metadata()  # raises the typed error itself
    flat = _target(metadata)
    dcp_volumes.load(flat, url, storage_options=storage_options, no_dist=True,
                     transfer=transfer, retry=retry, safe_globals=safe_globals)
    return _nested(flat, metadata.planner_data, url)
