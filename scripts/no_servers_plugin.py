"""pytest plugin (``-p no_servers_plugin``): deselect every test that needs an object-store server.

scripts/test_torch_versions.sh runs the core tests on each end of the supported torch range in
venvs that hold torch, the test tools and nothing else: no moto, SeaweedFS, fake-gcs or Azurite.
A test needs a server when it uses one of the server fixtures, directly or through a
parameter (``where=moto``), or carries the ``servers`` mark.
"""

from __future__ import annotations

from typing import Any

import pytest

SERVERS = frozenset({"moto", "seaweedfs", "fake_gcs", "fake-gcs", "azurite"})


def _needs_server(item: pytest.Item) -> bool:
    if item.get_closest_marker("servers") is not None:
        return True
    if SERVERS & set(getattr(item, "fixturenames", ())):
        return True
    callspec: Any = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return any(isinstance(v, str) and v in SERVERS for v in params)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (drop if _needs_server(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
