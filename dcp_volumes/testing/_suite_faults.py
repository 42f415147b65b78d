"""Conformance tests 6-7: transient faults, damage in transit, a dead store."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import (
    RetryOptions,
    SpoolOptions,
    errors,
)
from dcp_volumes.testing._suite_support import (
    FAST_RETRY,
    MiB,
    Store,
    SuiteBase,
    busy_body,
    data_write_matcher,
    failures_of,
    load_with,
    open_multipart_uploads,
    save_with,
    write_matcher,
)
from dcp_volumes.testing.states import assert_state_equal, mixed_state, zeros_like_state


class FaultTests(SuiteBase):
    # ---- 6. transient faults -----------------------------------------------------------
    def test_transient_faults_are_retried(self, store: Store) -> None:
        from dcp_volumes.testing.faultproxy import FaultRule

        with self._proxy(store) as (opts, proxy):
            writes = write_matcher(store)
            rules = [
                proxy.add_rule(FaultRule(action="status", status=503, times=3,
                                         body=busy_body(store), name="503 burst", **writes)),
                proxy.add_rule(FaultRule(action="reset", skip=1, times=2, name="resets",
                                         **writes)),
                proxy.add_rule(FaultRule(action="status", status=500, times=1,
                                         body=busy_body(store, 500), name="commit 500",
                                         **write_matcher(store, "metadata"))),
                proxy.add_rule(FaultRule(action="status", status=503, method="GET", times=2,
                                         path_regex="distcp", body=busy_body(store),
                                         name="read 503")),
            ]
            state = mixed_state(many=20)
            url = store.url()
            writer = save_with(state, url, store, storage_options=opts, retry=FAST_RETRY)
            out = zeros_like_state(state)
            reader = load_with(out, url, store, storage_options=opts, retry=FAST_RETRY)
            per_rule = [proxy.stats.rule(r) for r in rules]
        injected = sum(r.injected for r in per_rule)
        assert_state_equal(out, state)
        assert injected >= 4
        if self._has(store, "retries_visible"):
            assert writer.last_stats is not None and reader.last_stats is not None
            assert writer.last_stats.retries + reader.last_stats.retries >= 3, (
                writer.last_stats, reader.last_stats, per_rule)

    def test_upload_damaged_in_transit_never_loads(self, store: Store) -> None:
        from dcp_volumes.testing.faultproxy import FaultRule

        with self._proxy(store) as (opts, proxy):
            rule = proxy.add_rule(FaultRule(action="corrupt", times=1, name="flipped byte",
                                            **data_write_matcher(store)))
            state = {"w": torch.randn(3 * MiB)}  # 12 MiB: several parts
            url = store.url()
            writer = save_with(state, url, store, storage_options=opts, retry=FAST_RETRY,
                           spool=SpoolOptions(files_per_rank=1))
            assert proxy.stats.rule(rule).injected == 1
        out = {"w": torch.zeros(3 * MiB)}
        if self.verifies_upload_checksums:
            load_with(out, url, store)
            assert_state_equal(out, state)
            assert writer.last_stats is not None and writer.last_stats.retries >= 1
        else:
            with pytest.raises(CheckpointException) as info:
                load_with(out, url, store)
            (err,) = failures_of(info.value)
            assert isinstance(err, errors.IntegrityError), err
            assert "checksum mismatch" in str(err)

    # ---- 7. persistent fault -------------------------------------------------------------
    def test_persistent_fault_fails_cleanly(self, store: Store) -> None:
        from dcp_volumes.testing.faultproxy import FaultRule

        with self._proxy(store) as (opts, proxy):
            # Let the first upload request through so there is something to clean up.
            proxy.add_rule(FaultRule(action="status", status=503, skip=1, times=None,
                                     body=busy_body(store), name="dead store",
                                     **write_matcher(store)))
            url = store.url()
            start = time.monotonic()
            with pytest.raises(CheckpointException) as info:
                save_with({"a": torch.randn(4 * MiB)}, url, store, storage_options=opts,
                      retry=RetryOptions(max_attempts=3, initial_backoff_s=0.01,
                                         max_backoff_s=0.05),
                      spool=SpoolOptions(files_per_rank=1))
            elapsed = time.monotonic() - start
        errs = failures_of(info.value)
        assert any(isinstance(e, errors.UploadError) for e in errs), errs
        assert elapsed < self.persistent_fault_timeout_s
        assert ".metadata" not in store.names(url)
        if self._has(store, "multipart_listing"):
            assert open_multipart_uploads(store, url) == []

