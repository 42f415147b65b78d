"""One backend interface, one module per store.

:func:`parse_url` (:mod:`~dcp_volumes.backends.urls`) is the one URL parser: it maps a
checkpoint URL's scheme to the :class:`~dcp_volumes.backends.base.Backend` subclass that
serves it. :class:`~dcp_volumes.backends.location.StoreLocation` is the one validated location
(URL, backend, ``storage_options`` typed per backend in
:mod:`~dcp_volumes.backends.options`, checked once); :func:`open_backend` resolves a URL and
its options into a live backend through it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dcp_volumes.backends.base import Backend, CallStats, ObjectInfo, StaleUpload
from dcp_volumes.backends.location import StoreLocation
from dcp_volumes.backends.options import (
    AzureOptions,
    GCSOptions,
    LocalOptions,
    S3Options,
    StorageOptions,
)
from dcp_volumes.backends.translate import redact_url
from dcp_volumes.backends.urls import backend_class, parse_url
from dcp_volumes.config import RetryOptions

__all__ = [
    "AzureOptions",
    "Backend",
    "CallStats",
    "GCSOptions",
    "LocalOptions",
    "ObjectInfo",
    "S3Options",
    "StaleUpload",
    "StorageOptions",
    "StoreLocation",
    "backend_class",
    "open_backend",
    "parse_url",
    "redact_url",
]


def open_backend(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None,
                 retry: RetryOptions | None = None, *, pacing: bool = True) -> Backend:
    """Resolve ``url`` into a live :class:`Backend`, checking the URL and its options once
    (:meth:`StoreLocation.parse <dcp_volumes.backends.location.StoreLocation.parse>`).

    Args:
        pacing: react to throttling by pacing this process's requests to the store;
            ``False``: retries are the only reaction (``TransferOptions(throttle_backoff=
            False)``).
    """
    return StoreLocation.parse(url, storage_options).open(retry, pacing=pacing)
