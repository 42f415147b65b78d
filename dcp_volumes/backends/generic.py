"""Any other installed fsspec protocol: plain fsspec calls, the filesystem's own writer.

``.metadata`` is written with ``mode="create"``; whether that is atomic is up to the
filesystem (its conformance run says).
"""

from __future__ import annotations

from dcp_volumes.backends.base import Backend

__all__ = ["FsspecBackend"]


class FsspecBackend(Backend):
    name = "fsspec"
