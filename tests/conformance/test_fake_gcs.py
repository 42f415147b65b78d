"""fake-gcs-server (GCS JSON API) against the conformance suite.

The emulator checks no credentials (token="anon"). Shards stream through gcsfs' resumable
upload, whose retries happen inside gcsfs, so our figures do not count them.
"""

from __future__ import annotations

import pytest

from dcp_volumes.testing.suite import CheckpointStoreTests, Store

pytestmark = pytest.mark.xdist_group("fake-gcs")


class TestFakeGCS(CheckpointStoreTests):
    # the 8-rank tests run on SeaweedFS (S3) and local files; here they would add minutes
    many_ranks = 0
    persistent_fault_timeout_s = 120.0

    @pytest.fixture
    def store(self, fake_gcs) -> Store:
        return fake_gcs.store()
