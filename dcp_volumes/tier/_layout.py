"""The local tier's directory layout (torch-free: the catalog lists
tiers without importing torch).

::

    <tier>/<url key>/<save key>/<relative shard path>     a shard file, as it was uploaded
    <tier>/<url key>/<save key>/.dcpv-tier-<rank>.json    one rank's descriptor, written last

``url key``: the first 16 hex digits of the SHA-256 of the checkpoint URL (credentials
stripped, no trailing slash). ``save key``: the id in the rank's shard names. Ranks on one
node may share a tier: shard names carry the rank, descriptors too.

The descriptors (:mod:`._descriptor`) and the small file helpers (:mod:`._files`) have modules
of their own.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from dcp_volumes.backends.translate import redact_url
from dcp_volumes.tier._descriptor import Descriptor, descriptors
from dcp_volumes.tier._files import scandir

__all__ = ["STALE_S", "SaveDir", "is_save_key", "is_url_key", "name_under", "normal_url",
           "url_key", "walk_saves"]

#: a save directory with no descriptor this old is what a killed save left: removed
STALE_S = 3600.0
_URL_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_SAVE_KEY_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{12}$")


def normal_url(url: str | os.PathLike[str]) -> str:
    """A checkpoint URL as the tier records it: credentials stripped, no trailing slash."""
    return redact_url(os.fspath(url)).rstrip("/")


def url_key(url: str) -> str:
    """The directory name of a checkpoint URL's saves in the tier."""
    return hashlib.sha256(normal_url(url).encode()).hexdigest()[:16]


def name_under(root: str | os.PathLike[str], url: str) -> str | None:
    """The checkpoint's name directly under the run ``root`` (``step-00000100``), or None
    when ``url`` is not one level under it. Local paths compare as absolute paths."""
    def norm(u: str) -> str:
        n = normal_url(u)
        return n if "://" in n else os.path.abspath(n)

    prefix = norm(os.fspath(root)) + "/"
    u = norm(url)
    name = u[len(prefix):] if u.startswith(prefix) else ""
    return name if name and "/" not in name else None


def is_url_key(name: str) -> bool:
    return _URL_KEY_RE.match(name) is not None


def is_save_key(name: str) -> bool:
    return _SAVE_KEY_RE.match(name) is not None


@dataclass(frozen=True)
class SaveDir:
    """One save directory of the tier: ``<root>/<url_key>/<save_key>``."""

    url_key: str
    save_key: str
    path: str

    def descriptors(self, url: str | None = None) -> list[Descriptor]:
        """The well-formed descriptors here whose URL hashes to this directory."""
        return [d for d in descriptors(self.path, url, self.save_key)
                if url_key(d.url) == self.url_key]


def walk_saves(root: str, url: str | None = None) -> Iterator[SaveDir]:
    """Every save directory in the tier at ``root`` (of ``url`` only, when given); links and
    names that are not tier keys are skipped."""
    keys = [url_key(url)] if url is not None else None
    for udir in scandir(root):
        if not (is_url_key(udir.name) and udir.is_dir(follow_symlinks=False)):
            continue
        if keys is not None and udir.name not in keys:
            continue
        for sdir in scandir(udir.path):
            if is_save_key(sdir.name) and sdir.is_dir(follow_symlinks=False):
                yield SaveDir(udir.name, sdir.name, sdir.path)
