"""moto (S3 in Python) against the conformance suite. moto checks no credentials."""

from __future__ import annotations

import pytest

from dcp_volumes.testing.suite import CheckpointStoreTests, Store

pytestmark = pytest.mark.xdist_group("moto")


class TestMoto(CheckpointStoreTests):
    # the 8-rank tests run on SeaweedFS (S3) and local files; here they would add minutes
    many_ranks = 0
    @pytest.fixture
    def store(self, moto) -> Store:
        return moto.store(secrets=(moto.server.storage_options()["secret"],))
