"""Finding the committed save's files in this node's local tier, for a load to read.

Only files the committed manifest in the store names are looked for, at the sizes it names.
They are read by the load's local-tier source (:class:`dcp_volumes.loading.sources.
LocalTierSource`), and every byte read is checked against the manifest's CRC32C exactly as a
store read is (bytes from local disk are as untrusted as bytes from the store); what fails
goes to the store instead.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from dcp_volumes import _layout
from dcp_volumes._manifest import Manifest
from dcp_volumes.config import LocalTierOptions
from dcp_volumes.tier._descriptor import descriptors
from dcp_volumes.tier._layout import normal_url, url_key

__all__ = ["LocalFile", "find_local", "unusable"]


@dataclass(frozen=True)
class LocalFile:
    """A shard file of the committed save found in the tier at the size the manifest says."""

    path: str
    size: int


def find_local(options: LocalTierOptions, url: str, manifest: Manifest
               ) -> tuple[dict[str, LocalFile], dict[str, str]]:
    """The committed save's shard files this node's tier holds, by relative path, and those
    a descriptor lists but that cannot be used (with why): missing, a link, not a regular
    file, or of another size than the manifest's. Only files the committed ``manifest``
    names are looked for, in the directory of the id in their name."""
    root = os.path.realpath(options.resolved_directory())
    usable: dict[str, LocalFile] = {}
    rejected: dict[str, str] = {}
    if not os.path.isdir(root):
        return usable, rejected
    base = os.path.join(root, url_key(url))
    listed_by_key: dict[str, dict[str, int]] = {}
    normal = normal_url(url)
    for relative, entry in manifest.files.items():
        key = _layout.save_id_of(relative)
        if key is None:
            continue
        if key not in listed_by_key:
            listed: dict[str, int] = {}
            for d in descriptors(os.path.join(base, key), normal, key):
                listed.update(d.files)
            listed_by_key[key] = listed
        size = listed_by_key[key].get(relative)
        if size is None:
            continue  # not kept on this node
        path = os.path.join(base, key, relative)
        why = unusable(path, entry.size) if size == entry.size else (
            f"its descriptor says {size} bytes, the committed manifest {entry.size}")
        if why is None:
            usable[relative] = LocalFile(path, entry.size)
        else:
            rejected[relative] = why
    return usable, rejected


def unusable(path: str, size: int) -> str | None:
    """Why the file at ``path`` cannot stand for a shard of ``size`` bytes, or None."""
    if os.path.realpath(path) != path:
        return "a symbolic link is on its path"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_size != size:
        return f"it has {st.st_size} bytes, the committed manifest says {size}"
    return None
