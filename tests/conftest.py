"""Session-wide test setup: environment the local servers need before gcsfs is imported, and
the servers themselves: each starts once per session (per xdist worker) on free 127.0.0.1
ports, with a fault-injecting proxy in front, when a test first asks for it, and stops by PID
at the end. Conformance and integration tests share them."""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _direct import disk_dir  # noqa: F401  (the O_DIRECT fixture, for every module)

from dcp_volumes.testing.faultproxy import FaultProxy
from dcp_volumes.testing.servers import LocalServer, ServerNotAvailableError, start_server
from dcp_volumes.testing.suite import Store


class _Running:
    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.proxy = FaultProxy(server)
        self.proxy.start()
        self.bucket = f"dcpv-{uuid.uuid4().hex[:10]}"
        self.root = server.create_bucket(self.bucket)

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()

    def store(self, *, secrets: tuple[str, ...] = (), bad_credentials: dict[str, Any] | None = None
              ) -> Store:
        opts = self.server.storage_options()
        proxied = self.server.storage_options(endpoint_url=self.proxy.endpoint_url)
        scheme = self.root.split("://", 1)[0]
        return Store(
            root=f"{self.root}/t-{uuid.uuid4().hex[:10]}",
            storage_options=opts,
            proxied_options=lambda: (proxied, self.proxy),
            bad_credentials=bad_credentials,
            missing_bucket_root=f"{scheme}://no-such-bucket-{uuid.uuid4().hex[:8]}",
            secrets=secrets,
        )


def _running(name: str) -> Iterator[_Running]:
    try:
        server = start_server(name)
    except ServerNotAvailableError as exc:
        pytest.skip(f"{name} is not installed: {exc}")
    running = _Running(server)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[_Running]:
    yield from _running("seaweedfs")


@pytest.fixture(scope="session")
def moto() -> Iterator[_Running]:
    yield from _running("moto")


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[_Running]:
    yield from _running("fake-gcs")


@pytest.fixture(scope="session")
def azurite() -> Iterator[_Running]:
    yield from _running("azurite")
