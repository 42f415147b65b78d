"""Object names inside one checkpoint directory.

::

    <checkpoint>/
      .metadata                            standard pickled torch Metadata, written LAST
      .dcpv-manifest-<save_id>.json        integrity sidecar of save <save_id>
      __<rank>_<i>-<save_id>.distcp        shard files of save <save_id>
      .dcpv-live-<save_id>.json            live record of save <save_id> while it runs
      <hh>/__<rank>_<i>-<save_id>.distcp   shard files with TransferOptions(key_layout="hashed")

Shard and manifest names carry the save id, so two saves never write the same object:
an overwrite leaves the old save intact until the new ``.metadata`` replaces the old one.

With the opt-in hashed layout (:func:`hashed_shard_name`) each shard file sits one directory
down, in one of 256 directories named by two hex digits hashed from its rank and file index,
so that a save's requests spread over many key prefixes (S3 rates are per partitioned prefix).
The directory depends on (rank, index) only: the same rank's files land under the same
prefixes save after save. ``.metadata`` records the relative paths, so readers need nothing
else to find the files.

The live record says "save <save_id> may still be running": the coordinator writes it at plan
time, every rank rewrites it every :data:`LIVE_REFRESH_S` seconds while it uploads, and the
coordinator removes it once the save committed or failed. ``gc`` leaves alone every object of
a save whose live record was written less than :data:`LIVE_STALE_S` ago.
"""

from __future__ import annotations

import posixpath
import re
import secrets
import time
import zlib

from dcp_volumes.errors import UnsafeCheckpointError

__all__ = [
    "LIVE_PREFIX",
    "LIVE_REFRESH_S",
    "LIVE_STALE_S",
    "MANIFEST_PREFIX",
    "METADATA",
    "check_relative_path",
    "hashed_shard_name",
    "live_name",
    "live_save_id_of",
    "manifest_name",
    "new_save_id",
    "save_id_of",
    "shard_name",
    "shard_path",
]

METADATA = ".metadata"
MANIFEST_PREFIX = ".dcpv-manifest-"
SHARD_SUFFIX = ".distcp"
LIVE_PREFIX = ".dcpv-live-"
#: seconds between two rewrites of a running save's live record (by each uploading rank)
LIVE_REFRESH_S = 30.0
#: a live record younger than this marks a save that may still be running, whatever age
#: threshold gc was given: four missed refreshes
LIVE_STALE_S = 4 * LIVE_REFRESH_S

_SAVE_ID_RE = r"[0-9a-f]{8}-[0-9a-f]{12}"
# Flat (``__0_1-<id>.distcp``) or hashed (``3f/__0_1-<id>.distcp``) shard names.
_SHARD_RE = re.compile(rf"^(?:[0-9a-f]{{2}}/)?__(\d+)_(\d+)-({_SAVE_ID_RE})\.distcp$")
_MANIFEST_RE = re.compile(rf"^{re.escape(MANIFEST_PREFIX)}({_SAVE_ID_RE})\.json$")
_LIVE_RE = re.compile(rf"^{re.escape(LIVE_PREFIX)}({_SAVE_ID_RE})\.json$")


def new_save_id() -> str:
    """A save id: seconds since the epoch (hex, so ids sort by time) and 48 random bits."""
    return f"{int(time.time()) & 0xFFFFFFFF:08x}-{secrets.token_hex(6)}"


def shard_name(rank: int, index: int, save_id: str) -> str:
    return f"__{rank}_{index}-{save_id}{SHARD_SUFFIX}"


def hashed_shard_name(rank: int, index: int, save_id: str) -> str:
    """:func:`shard_name` under its hashed prefix directory (``3f/__0_1-<id>.distcp``)."""
    digest = zlib.crc32(f"{rank}_{index}".encode()) & 0xFF
    return f"{digest:02x}/{shard_name(rank, index, save_id)}"


def shard_path(layout: str, rank: int, index: int, save_id: str) -> str:
    """The relative path of a shard file in ``layout`` (``"flat"`` or ``"hashed"``)."""
    if layout == "hashed":
        return hashed_shard_name(rank, index, save_id)
    return shard_name(rank, index, save_id)


def manifest_name(save_id: str) -> str:
    return f"{MANIFEST_PREFIX}{save_id}.json"


def live_name(save_id: str) -> str:
    return f"{LIVE_PREFIX}{save_id}.json"


def live_save_id_of(name: str) -> str | None:
    """The save id of a live record's name, else None."""
    m = _LIVE_RE.match(name)
    return m.group(1) if m else None


def save_id_of(name: str) -> str | None:
    """The save id embedded in a shard or manifest name written by dcp_volumes, else None."""
    m = _SHARD_RE.match(name) or _MANIFEST_RE.match(name)
    return m.group(m.re.groups) if m else None


def is_save_id(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(_SAVE_ID_RE, value) is not None


def check_relative_path(path: object) -> str:
    """Refuse stored paths that could escape the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise UnsafeCheckpointError(f"stored relative path {path!r} is not a non-empty string")
    if (
        path.startswith(("/", "\\", "~"))
        or "://" in path
        or "\\" in path
        or "\x00" in path
        or re.match(r"^[A-Za-z]:", path)
        or any(part in ("..", ".") for part in path.split("/"))
        or posixpath.normpath(path) != path
    ):
        raise UnsafeCheckpointError(
            f"stored relative path {path!r} escapes the checkpoint directory; refusing to read it"
        )
    return path
