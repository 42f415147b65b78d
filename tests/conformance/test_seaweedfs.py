"""SeaweedFS (a real S3 server) against the conformance suite."""

from __future__ import annotations

import pytest

from dcp_volumes.testing.suite import CheckpointStoreTests, Store

pytestmark = pytest.mark.xdist_group("seaweedfs")


class TestSeaweedFS(CheckpointStoreTests):
    verifies_upload_checksums = True

    @pytest.fixture
    def store(self, seaweedfs) -> Store:
        opts = seaweedfs.server.storage_options()
        return seaweedfs.store(secrets=(opts["secret"],),
                               bad_credentials={**opts, "secret": "wrong-" + opts["secret"]})
