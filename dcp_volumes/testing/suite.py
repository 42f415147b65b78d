"""The dcp_volumes conformance suite: a pytest base class every backend's test module subclasses.

Usage (see ``docs/conformance.md``)::

    from dcp_volumes.testing.suite import CheckpointStoreTests, Store

    class TestMyStore(CheckpointStoreTests):
        conditional_create = True            # capability flags, see below

        @pytest.fixture
        def store(self, my_server) -> Store:
            return Store(root="myproto://bucket/prefix-" + uuid4().hex, storage_options={...})

Every check reads and writes "behind the writer's back" through :attr:`Store.raw_fs`, a
separate fsspec instance, so the code under test never checks itself. A capability a
backend lacks is declared by a class attribute, and the tests that need it skip with the
reason.
"""

from __future__ import annotations

from dcp_volumes.testing._suite_durability import DurabilityTests
from dcp_volumes.testing._suite_faults import FaultTests
from dcp_volumes.testing._suite_safety import SafetyTests
from dcp_volumes.testing._suite_scale import ScaleTests
from dcp_volumes.testing._suite_support import SlowPlanner, Store, failures_of

__all__ = ["CheckpointStoreTests", "SlowPlanner", "Store", "failures_of"]


class CheckpointStoreTests(DurabilityTests, FaultTests, SafetyTests, ScaleTests):
    """Conformance tests every dcp_volumes backend must pass (see ``docs/conformance.md``).

    Capability flags and the ``store`` fixture: see
    :class:`~dcp_volumes.testing._suite_support.SuiteBase`.
    """
