"""One validated store location: URL, the backend that serves it, its typed options.

Everything that takes ``storage_options=`` (writer, reader, Checkpointer, the catalog,
export, the integrations, the CLI) builds a :class:`StoreLocation` and opens its backend
from it, so a URL and its options are checked in one place, once. It is configuration only
(frozen, picklable, no live client) and never shows an option's value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dcp_volumes.backends.base import Backend
from dcp_volumes.backends.options import StorageOptions, check_storage_options
from dcp_volumes.backends.translate import redact_url
from dcp_volumes.backends.urls import parse_url
from dcp_volumes.config import RetryOptions

__all__ = ["StoreLocation"]


@dataclass(frozen=True)
class StoreLocation:
    """A checkpoint (or run root) URL with its backend and its checked ``storage_options``.

    Build one with :meth:`parse`; :meth:`open` makes the live backend.

    Attributes:
        url: the URL as given (``os.fspath`` of a path).
        backend: the :class:`~dcp_volumes.backends.base.Backend` subclass that serves it.
        options: the checked options (a read-only dict; its ``repr`` names keys only).
    """

    url: str
    backend: type[Backend] = field(repr=False)
    options: StorageOptions = field(repr=False)

    @classmethod
    def parse(cls, url: object, storage_options: object = None) -> StoreLocation:
        """Check ``url`` (:func:`~dcp_volumes.backends.urls.parse_url`) and its options.

        Raises:
            ConfigError: the URL or the options are not usable; the message says what to
                change and never shows an option's value.
        """
        _, backend = parse_url(url)
        path = os.fspath(url)  # type: ignore[call-overload]
        return cls(path, backend, check_storage_options(storage_options, backend.name))

    @property
    def kind(self) -> str:
        """The backend's name: ``"s3"``, ``"gcs"``, ``"azure"``, ``"local"``, ..."""
        return self.backend.name

    def at(self, url: object) -> StoreLocation:
        """The same options at another URL (checked again only for another backend)."""
        if url == self.url:
            return self
        return StoreLocation.parse(url, self.options)

    def open(self, retry: RetryOptions | None = None, *, pacing: bool = True) -> Backend:
        """A live backend for this location (not picklable: open one per process).

        Args:
            retry: the retry policy of its requests (default ``RetryOptions()``).
            pacing: react to throttling by pacing this process's requests to the store
                (``TransferOptions.throttle_backoff``); ``False``: retries only.
        """
        return self.backend(self.url, self.options, retry or RetryOptions(), pacing=pacing)

    def __repr__(self) -> str:
        return f"StoreLocation({redact_url(self.url)!r}, {self.options!r})"
