"""Azurite (Azure Blob) against the conformance suite."""

from __future__ import annotations

import pytest

from dcp_volumes.testing.servers import AZURITE_ACCOUNT_KEY
from dcp_volumes.testing.suite import CheckpointStoreTests, Store

pytestmark = pytest.mark.xdist_group("azurite")

_WRONG_KEY = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ=="


class TestAzurite(CheckpointStoreTests):
    # the 8-rank tests run on SeaweedFS (S3) and local files; here they would add minutes
    many_ranks = 0
    @pytest.fixture
    def store(self, azurite) -> Store:
        opts = azurite.server.storage_options()
        bad = {"connection_string": opts["connection_string"].replace(AZURITE_ACCOUNT_KEY,
                                                                      _WRONG_KEY)}
        return azurite.store(secrets=(AZURITE_ACCOUNT_KEY,), bad_credentials=bad)
