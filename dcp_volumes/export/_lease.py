"""Who owns an export's destination: the lease object, and the names an export may delete.

An export claims DEST by writing :data:`MARKER` (its token and the files it plans) before it
removes or writes anything, and gives it up by deleting it once the index is committed. The
newest claim wins: an export re-reads the marker before it completes each file and before it
commits, and stops with :class:`~dcp_volumes.errors.ExportConflictError` when another export
has claimed DEST since (so of two racing exports at most one commits). The ranks of one
export share one token, so every rank also checks that it sees rank 0's marker: a DEST that
differs per node is :class:`~dcp_volumes.errors.DestinationMismatchError` before any file.

The marker, an earlier export's index and every other object at DEST are untrusted input:
each is size-capped, and only names of this exporter's scheme are ever taken from them
(:func:`owned`), so an export deletes nothing a user put there under another name.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from dcp_volumes import errors
from dcp_volumes.backends import Backend, redact_url
from dcp_volumes.export._plan import INDEX, NUMBERED_RE, SINGLE

__all__ = ["MARKER", "Claim", "index_files", "owned", "read_claim", "write_claim"]

#: the lease object at DEST while an export runs (removed when it commits)
MARKER = ".dcp-volumes-export.json"
#: the largest marker or earlier index read (a 10**4-file model's index is about 1 MB)
MAX_READ_BYTES = 16 * 2**20
_TOKEN_RE = re.compile(r"^[0-9a-f]{16}$")


def owned(name: object) -> bool:
    """Whether ``name`` is one of the names an export writes (its data files)."""
    return isinstance(name, str) and (name == SINGLE or NUMBERED_RE.match(name) is not None)


@dataclass(frozen=True)
class Claim:
    """What the marker says: the export's token and the files it writes."""

    token: str
    files: tuple[str, ...] = ()

    def temporaries(self) -> list[str]:
        """The temporary names its files have on a local DEST before they are renamed."""
        return [f"{n}.{self.token}.tmp" for n in self.files] if self.token else []


_ABSENT = object()


def _read_json(backend: Backend, name: str) -> object:
    """The parsed JSON of ``name``: ``_ABSENT`` when there is no such object, None when it
    is unreadable, too big or not JSON."""
    size = backend.run(lambda: backend.size(name))
    if size is None:
        return _ABSENT
    if size > MAX_READ_BYTES:
        return None
    try:
        data = backend.run(lambda: backend.cat(name))
    except errors.ObjectNotFoundError:
        return _ABSENT  # removed since its size was read
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def read_claim(backend: Backend) -> Claim | None:
    """The marker at DEST (None when there is none); one that does not parse owns nothing."""
    doc = _read_json(backend, MARKER)
    if doc is _ABSENT:
        return None
    token = doc.get("export") if isinstance(doc, dict) else None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        return Claim("")
    return Claim(token, tuple(f for f in files if owned(f)) if isinstance(files, list) else ())


def write_claim(backend: Backend, claim: Claim) -> None:
    """Claim DEST (one atomic write; the newest claim wins)."""
    data = json.dumps({"export": claim.token, "files": list(claim.files),
                       "started": time.time()}).encode()
    backend.run(lambda: backend.commit(MARKER, data, exclusive=False, save_id=claim.token))


def index_files(backend: Backend) -> list[str]:
    """The data files an earlier export's index at DEST names (only names of the scheme)."""
    doc = _read_json(backend, INDEX)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return []
    return sorted({f for f in weight_map.values() if owned(f)})


def conflict(backend: Backend, action: str) -> errors.ExportConflictError:
    return errors.ExportConflictError(
        f"another export to {redact_url(backend.url)} started after this one and took the "
        f"destination over, so this one stopped {action} without committing: DEST holds the "
        "other export's output once it completes. Run one export per destination at a time")


def mismatch(backend: Backend, rank: int, found: Claim | None) -> errors.DestinationMismatchError:
    seen = ("no marker" if found is None else "the marker of another export")
    return errors.DestinationMismatchError(
        f"rank {rank} finds {seen} at {redact_url(backend.url)}, where rank 0 has just "
        "claimed the destination: the ranks do not see the same DEST (a local directory "
        "differs per node). Export to a shared filesystem or an object store, or on one rank; "
        "nothing was written")
