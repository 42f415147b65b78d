"""Deleting one checkpoint so that a delete stopped at any request leaves either a complete
checkpoint or garbage that :func:`~dcp_volumes.catalog.gc` removes.

A save commits last (``.metadata``); a delete un-commits first. In order:

1. Only when the directory holds a file gc would not remove (one that is not a checkpoint
   file: gc leaves such a directory alone, so as never to destroy what is not its own), a
   **removal marker** (:data:`REMOVING`) is written next to ``.metadata``: it records that
   the whole directory was asked to go, and lets gc finish the job. A failure here, or at
   step 2, leaves the checkpoint complete (a stale marker inside a complete checkpoint is a
   ``.metadata.*.tmp`` leftover, which gc removes).
2. ``.metadata``, in a request of its own: the one instant the checkpoint stops being
   visible. ``.metadata`` is not deleted last: a delete stopped after some shards went would
   leave a committed checkpoint that cannot load, which nothing may collect.
3. Everything else (shards, manifests, any other file), one request per 1,000 keys on S3.
4. The markers, last, so that a directory holding anything but checkpoint files keeps one
   while it does.

Every delete path that removes a committed checkpoint goes through :func:`delete_checkpoint`
(``rm``, retention, gc, the Checkpointer's retention, the torch_checkpointing adapter's
``rmdir``). The other deletes remove objects that no ``.metadata`` names (a superseded save
after an overwrite's commit, a losing or failed save's own objects), so no order matters
there.
"""

from __future__ import annotations

import asyncio
import posixpath

from dcp_volumes import _layout
from dcp_volumes.backends import Backend, ObjectInfo
from dcp_volumes.catalog._common import is_artifact

__all__ = ["REMOVING", "delete_checkpoint"]

#: the removal marker: a ``.metadata.*.tmp`` name, so a checkpoint file to every reader
REMOVING = f"{_layout.METADATA}.removing.tmp"
_MARKER_TEXT = (b"dcp-volumes: this checkpoint is being removed; `dcp-volumes gc` finishes "
                b"the removal if it was interrupted\n")


def _beside(name: str, sibling: str) -> str:
    parent = posixpath.dirname(name)
    return f"{parent}/{sibling}" if parent else sibling


async def delete_checkpoint(backend: Backend, prefix: str, objects: list[ObjectInfo]) -> None:
    """Delete ``objects`` (names relative to ``prefix``) in the order above.

    Raises:
        DeleteError: a request failed (or the store did not confirm it): what was not yet
            deleted stays, as a complete checkpoint or as garbage gc removes.
    """

    def rel(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    names = [o.name for o in objects]
    commits = [n for n in names if posixpath.basename(n) == _layout.METADATA]
    markers = {n for n in names if posixpath.basename(n) == REMOVING}
    if commits and not all(is_artifact(n) for n in names):
        written = [_beside(c, REMOVING) for c in commits]
        await asyncio.gather(*(backend.put(rel(m), _MARKER_TEXT) for m in written))
        markers.update(written)
    await backend.remove([rel(n) for n in commits])
    await backend.remove([rel(n) for n in names if n not in markers and n not in commits])
    await backend.remove([rel(m) for m in sorted(markers)])
    await backend.prune_empty_dirs(prefix)  # stores with real directories: the empty ones go
