"""What :func:`~dcp_volumes.catalog.verify` found: one report per file, one for the
checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FileReport", "VerifyReport"]


@dataclass
class FileReport:
    """What :func:`verify` found for one file.

    Attributes:
        name: the file, relative to the checkpoint.
        status: ``"ok"``, ``"missing"``, ``"link outside the checkpoint"`` (local files: a
            symbolic link, never read), ``"size mismatch"``, ``"checksum mismatch"`` or
            ``"not in manifest"``.
        expected_size: the size the manifest records (no manifest: the least size the items
            named in ``.metadata`` need).
        actual_size: the stored size, ``None`` when missing.
        bad_items: the items whose checksum or length did not match, described.
    """

    name: str
    status: str
    expected_size: int
    actual_size: int | None = None
    bad_items: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        url: the checkpoint.
        save_id: the committed save's id (``None`` for checkpoints written by torch's writers).
        checksummed: the items' CRC32C were checked (a manifest was there).
        note: what was and was not checked, in words.
        files: one :class:`FileReport` per file.
        bytes_read: bytes read back from the store.
    """

    url: str
    save_id: str | None
    checksummed: bool
    note: str
    files: list[FileReport]
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        """Every file is as recorded."""
        return all(f.ok for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        return doc
