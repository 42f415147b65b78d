"""One exception hierarchy for dcp_volumes.

Every error the package raises derives from :class:`DCPVolumesError`. Leaves also
subclass the builtin a caller would naturally catch, so ``except FileExistsError``
keeps working for code that does not know this package.
"""

from __future__ import annotations

__all__ = [
    "BucketNotFoundError",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConfigError",
    "DCPVolumesError",
    "DeleteError",
    "DestinationMismatchError",
    "DownloadError",
    "ExportConflictError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "ObjectNotFoundError",
    "RangeMismatchError",
    "RootInUseError",
    "ShortBodyError",
    "SpoolError",
    "StoragePermissionError",
    "UnsafeCheckpointError",
    "UnsupportedTransformError",
    "UploadError",
]


class DCPVolumesError(Exception):
    """Root of every error raised by dcp_volumes."""


class ConfigError(DCPVolumesError, ValueError):
    """An option or URL is invalid; the message says what to change."""


class CheckpointExistsError(DCPVolumesError, FileExistsError):
    """A complete checkpoint already exists at the target and ``overwrite`` is off,
    or a concurrent save committed first."""


class CheckpointNotFoundError(DCPVolumesError, FileNotFoundError):
    """Nothing (no ``.metadata`` and no shards) exists at the checkpoint URL."""


class IncompleteCheckpointError(DCPVolumesError):
    """Shard files exist but ``.metadata`` does not: a save was interrupted or is running."""


class IntegrityError(DCPVolumesError):
    """Stored bytes do not match the checksum or size recorded at save time."""


class CheckpointChangedError(IntegrityError):
    """An object changed between the read of its header and the read of its data (a file
    replaced while it was loaded): its version is not the one the load was planned from."""


class UploadError(DCPVolumesError, OSError):
    """Bytes could not be made durable in the store (after retries where transient)."""


class DeleteError(DCPVolumesError, OSError):
    """Objects could not be deleted from the store (after retries where transient), or the
    store's answer did not confirm that they were; the message says which remain."""


class DownloadError(DCPVolumesError, OSError):
    """Bytes could not be read from the store (after retries where transient)."""


class RangeMismatchError(DownloadError):
    """A GET was answered with other bytes than those asked for: a status other than 206
    (200 only where the whole object was asked), a ``Content-Range`` naming another range,
    or a length other than that range's. The store, or a proxy in front of it, does not
    honour HTTP ``Range``: not retried, and none of the answer's bytes are used."""


class ShortBodyError(DownloadError):
    """A GET's body ended before the length its answer announced (the connection dropped
    or was cut midway): retried, and raised once the retries are spent."""


class SpoolError(DCPVolumesError, OSError):
    """The local spool cannot hold the rank's bytes or could not be written."""


class StoragePermissionError(DCPVolumesError, PermissionError):
    """The store refused the credentials or the operation (HTTP 401/403)."""


class UnsafeCheckpointError(DCPVolumesError):
    """Stored metadata tried to load a class outside the allow-list, or a stored
    path tries to escape the checkpoint's root."""


class UnsupportedTransformError(DCPVolumesError):
    """Stored items were written through a stream transform (torch's ``_extensions``) that
    this installation cannot decode: an unknown one, or a known one whose package is
    missing; the message names the transform and what to install."""


class BucketNotFoundError(DCPVolumesError, FileNotFoundError):
    """The bucket or container in the URL does not exist."""


class ObjectNotFoundError(DCPVolumesError, FileNotFoundError):
    """A single object the operation needed does not exist."""


class RootInUseError(DCPVolumesError):
    """Another run holds the run root (its lease is live): two runs saving under one root
    would resume from and replace each other's checkpoints."""


class ExportConflictError(DCPVolumesError):
    """Another export to the same destination started after this one and took it over: this
    one stopped without committing (the other one's output is what DEST holds)."""


class DestinationMismatchError(ConfigError):
    """The ranks of one multi-rank operation do not see the same destination (a local
    directory that differs per node, say): nothing was written."""
