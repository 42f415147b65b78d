"""What :func:`~dcp_volumes.catalog.gc` removed (or would remove)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GcReport"]


@dataclass
class GcReport:
    """What :func:`gc` removed (or would remove, with ``dry_run``).

    Attributes:
        root: the run root.
        dry_run: nothing was deleted.
        older_than_s: the age threshold used.
        incomplete: URLs of stale incomplete checkpoints (no ``.metadata``).
        leftovers: URLs of objects inside complete checkpoints that belong to no committed save
            (a killed or losing save's shards and manifests, stale live records and commit
            temp files).
        uploads: stale multipart uploads: ``{"key", "upload_id", "initiated"}`` (S3 only).
        bytes: bytes the removed objects held (uploaded parts not counted).
        skipped: what was left alone, and why (saves that may still be running among them).
    """

    root: str
    dry_run: bool
    older_than_s: float
    incomplete: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to collect."""
        return not (self.incomplete or self.leftovers or self.uploads)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
