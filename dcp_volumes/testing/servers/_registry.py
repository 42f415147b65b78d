"""The servers by name, and :func:`start_server`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dcp_volumes.testing.servers._azure import AzuriteServer
from dcp_volumes.testing.servers._base import LocalServer
from dcp_volumes.testing.servers._gcs import FakeGCSServer
from dcp_volumes.testing.servers._s3 import MotoServer, SeaweedFSServer

__all__ = ["SERVERS", "running_server", "start_server"]

#: Server classes by name.
SERVERS: dict[str, type[LocalServer]] = {
    cls.name: cls for cls in (SeaweedFSServer, MotoServer, FakeGCSServer, AzuriteServer)
}


def start_server(name: str, **kwargs: Any) -> LocalServer:
    """Create and start the server called ``name`` (a key of :data:`SERVERS`).

    Args:
        name: ``"seaweedfs"``, ``"moto"``, ``"fake-gcs"`` or ``"azurite"``.
        **kwargs: Passed to the server class.

    Returns:
        The running server; stop it with :meth:`LocalServer.stop` or use it as a context
        manager.
    """
    try:
        cls = SERVERS[name]
    except KeyError:
        raise ValueError(f"unknown server {name!r}; choose one of {sorted(SERVERS)}") from None
    server = cls(**kwargs)
    server.start()
    return server


@contextlib.contextmanager
def running_server(name: str, **kwargs: Any) -> Iterator[LocalServer]:
    """Context manager form of :func:`start_server`."""
    server = start_server(name, **kwargs)
    try:
        yield server
    finally:
        server.stop()
