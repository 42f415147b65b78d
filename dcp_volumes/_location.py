"""The configuration shared by ``VolumeWriter`` and ``VolumeReader``: location and retries."""

from __future__ import annotations

import os
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends import Backend, StoreLocation, parse_url
from dcp_volumes.config import RetryOptions, TransferOptions, checked_option

__all__ = ["Location"]


class Location:
    """A checkpoint's :class:`~dcp_volumes.backends.StoreLocation` and retry policy, and a
    lazily opened Backend.

    The shared part of ``VolumeWriter`` and ``VolumeReader``: the URL and ``storage_options``
    are checked once, on construction, and it pickles as configuration only (no live client,
    loop or thread), so a writer can cross into ``AsyncCheckpointerType.PROCESS``'s worker
    process.
    """

    def _init_location(self, path: str | os.PathLike[str], storage_options: object,
                       retry: RetryOptions | None) -> None:
        self._where = StoreLocation.parse(path, storage_options)
        self.retry = checked_option("retry", retry, RetryOptions) or RetryOptions()
        self._backend_obj: Backend | None = None

    @property
    def location(self) -> StoreLocation:
        """The checkpoint's URL, backend and checked ``storage_options``."""
        return self._where

    @property
    def url(self) -> str:
        """The checkpoint URL."""
        return self._where.url

    @property
    def _url(self) -> str:
        return self._where.url

    @property
    def checkpoint_id(self) -> str:
        return self._where.url

    def backend(self) -> Backend:
        """The live :class:`~dcp_volumes.backends.Backend` this reader or writer talks to:
        opened on first use, shared by every call after, never pickled (a clone opens its
        own). The seam for a subclass that reads the store itself (a reader's
        ``open_checkpoint``) and for test harnesses."""
        if self._backend_obj is None:
            transfer = getattr(self, "transfer", None)  # writers' and readers' TransferOptions
            pacing = not isinstance(transfer, TransferOptions) or transfer.throttle_backoff
            self._backend_obj = self._where.open(self.retry, pacing=pacing)
        return self._backend_obj

    def _switch_url(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """DCP's ``reset(checkpoint_id)``: point at another checkpoint (validated)."""
        if checkpoint_id is not None:
            where = self._where.at(checkpoint_id)
            if where is not self._where:
                self._where = where
                self._backend_obj = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_backend_obj"] = None
        return state

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            parse_url(checkpoint_id)
        except errors.DCPVolumesError:
            return False
        return True
