"""The local filesystem and fsspec's in-process memory filesystem against the suite."""

from __future__ import annotations

import uuid

import pytest

from dcp_volumes.testing.suite import CheckpointStoreTests, Store

pytestmark = pytest.mark.xdist_group("local")


class TestLocal(CheckpointStoreTests):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return Store(root=str(tmp_path / "ckpts"))


class TestMemory(CheckpointStoreTests):
    @pytest.fixture
    def store(self) -> Store:
        return Store(root=f"memory://dcpv-conformance/{uuid.uuid4().hex}")
