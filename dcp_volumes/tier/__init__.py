"""The local tier: a node-local replica of each save, read first when loading.

Modules, each with one job:

- ``_layout``: directory layout, keys, the :class:`Descriptor` (its own parse and
  serialize, every field checked), one walk over saves; torch-free.
- ``_write``: a rank's files of one save going in (:class:`TierSave`).
- ``_retention``: ``keep_last`` / ``max_bytes`` over the whole tier directory.
- ``_read``: finding the committed save's files (read by ``dcp_volumes.loading.sources``).
- ``_local_only``: local-only saves, their commit files and lineage, finding them.
- ``_replicas``: own copies sent to a partner, partner copies arriving.
- ``_partners``: the partner map and the post-save exchange over gloo.

The store's ``.metadata`` is the one truth of what is durable; everything in a tier is
untrusted and checked against a manifest before it is used.

The names are resolved lazily (module ``__getattr__``), so the layout and descriptors are
used without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcp_volumes.tier._descriptor import Descriptor, DurableBase
    from dcp_volumes.tier._layout import name_under, normal_url, walk_saves
    from dcp_volumes.tier._local_only import (
        LocalCommit,
        LocalOnlyCopy,
        find_local_only,
        parse_commit,
    )
    from dcp_volumes.tier._partners import replicate
    from dcp_volumes.tier._read import LocalFile, find_local
    from dcp_volumes.tier._write import TierSave

__all__ = ["Descriptor", "DurableBase", "LocalCommit", "LocalFile", "LocalOnlyCopy", "TierSave",
           "find_local", "find_local_only", "name_under", "normal_url", "parse_commit", "replicate",
           "walk_saves"]

_LAZY: dict[str, str] = {
    "Descriptor": "dcp_volumes.tier._descriptor",
    "DurableBase": "dcp_volumes.tier._descriptor",
    "name_under": "dcp_volumes.tier._layout",
    "normal_url": "dcp_volumes.tier._layout",
    "walk_saves": "dcp_volumes.tier._layout",
    "LocalCommit": "dcp_volumes.tier._local_only",
    "LocalOnlyCopy": "dcp_volumes.tier._local_only",
    "find_local_only": "dcp_volumes.tier._local_only",
    "parse_commit": "dcp_volumes.tier._local_only",
    "replicate": "dcp_volumes.tier._partners",
    "LocalFile": "dcp_volumes.tier._read",
    "find_local": "dcp_volumes.tier._read",
    "TierSave": "dcp_volumes.tier._write",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
