"""The configuration shared by ``VolumeWriter`` and ``VolumeReader``: URL, options, retries."""

from __future__ import annotations

import os
from typing import Any

from dcp_volumes import errors
from dcp_volumes.backends import Backend, open_backend, parse_url
from dcp_volumes.config import RetryOptions, TransferOptions

__all__ = ["Location"]


class Location:
    """A checkpoint URL, its fsspec options and retry policy, and a lazily opened Backend.

    The shared part of ``VolumeWriter`` and ``VolumeReader``: it validates the URL on
    construction and pickles as configuration only (no live client, loop or thread), so a
    writer can cross into ``AsyncCheckpointerType.PROCESS``'s worker process.
    """

    def _init_location(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None,
                       retry: RetryOptions | None) -> None:
        parse_url(path)
        self._url = os.fspath(path)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise errors.ConfigError("storage_options must be a dict of fsspec options or None")
        if retry is not None and not isinstance(retry, RetryOptions):
            raise errors.ConfigError(f"retry= must be a RetryOptions, got {type(retry).__name__}")
        self._storage_options = dict(storage_options or {})
        self.retry = retry or RetryOptions()
        self._backend_obj: Backend | None = None

    @property
    def url(self) -> str:
        """The checkpoint URL."""
        return self._url

    @property
    def checkpoint_id(self) -> str:
        return self._url

    def _backend(self) -> Backend:
        if self._backend_obj is None:
            backend = open_backend(self._url, self._storage_options, self.retry)
            transfer = getattr(self, "transfer", None)  # writers' and readers' TransferOptions
            if isinstance(transfer, TransferOptions) and not transfer.throttle_backoff:
                backend.throttle = None  # retries only: no pacing, no concurrency cuts
            self._backend_obj = backend
        return self._backend_obj

    def _switch_url(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """DCP's ``reset(checkpoint_id)``: point at another checkpoint (validated)."""
        if checkpoint_id is not None:
            parse_url(checkpoint_id)
            url = os.fspath(checkpoint_id)
            if url != self._url:
                self._url = url
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
