"""Throttling end to end: the fault proxy's per-prefix rate limit, multi-rank saves through it
with the reaction on and off, and the opt-in hashed key layout (stock torch readers included).

The proxy limit is tiny (requests per second, not thousands) so that a few ranks of small
tensors run into it on this machine; the shape is what S3 does per partitioned prefix.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import SpoolOptions, TransferOptions, VolumeReader, VolumeWriter, _layout
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.faultproxy import (
    S3_SLOWDOWN_XML,
    FaultProxy,
    FaultRule,
    PrefixRateLimit,
    gcs_rate_limited,
    s3_slowdown,
)
from dcp_volumes.testing.throttling import rank_state, save_own_keys

# ---------------------------------------------------------------------------------------------
# the proxy's rate limit, against a plain HTTP upstream


class _Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = _reply

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _statuses(port: int, method: str, paths: list[str]) -> list[tuple[int, bytes]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    for path in paths:
        conn.request(method, path, body=b"x" if method == "PUT" else None)
        resp = conn.getresponse()
        out.append((resp.status, resp.read()))
    conn.close()
    return out


def test_rate_limit_answers_slowdown_per_prefix(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        limit = proxy.add_rate_limit(PrefixRateLimit(rate=2, burst=3))
        a = _statuses(proxy.port, "PUT", [f"/bkt/run/a/obj{i}" for i in range(5)])
        # another prefix has its own bucket; the bucket-level request counts as "bkt"
        b = _statuses(proxy.port, "PUT", ["/bkt/run/b/obj", "/bkt?list-type=2"])
        assert [s for s, _ in a] == [200, 200, 200, 503, 503]
        assert a[-1][1] == S3_SLOWDOWN_XML  # answered like S3; the upstream never saw it
        assert [s for s, _ in b] == [200, 200]
        time.sleep(0.6)  # 2 requests/s: one token back
        assert [s for s, _ in _statuses(proxy.port, "PUT", ["/bkt/run/a/x", "/bkt/run/a/y"])
                ] == [200, 503]
        stats = proxy.stats
        counts = stats.rate_limit(limit)
        assert counts.accepted == 6 and counts.throttled == 3 and stats.throttled == 3
        assert counts.prefixes["bkt/run/a"].accepted == 4
        assert counts.prefixes["bkt/run/a"].throttled == 3
        assert counts.prefixes["bkt/run/b"].accepted == 1 and "bkt" in counts.prefixes
        assert stats.faults_injected == 0  # throttles are not fault-rule injections
        proxy.reset_stats()
        assert proxy.stats.rate_limit(limit).accepted == 0


def test_rate_limit_depth_method_and_answer(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        # depth=2: every run/ prefix shares one bucket; only PUTs count; GCS-style answer
        proxy.add_rate_limit(PrefixRateLimit(rate=0.1, burst=1, depth=2, method="PUT",
                                             answer=gcs_rate_limited()))
        assert [s for s, _ in _statuses(proxy.port, "PUT", ["/bkt/run/a/x", "/bkt/run/b/y"])
                ] == [200, 429]
        assert [s for s, _ in _statuses(proxy.port, "GET", ["/bkt/run/a/x"] * 3)] == [200] * 3
        # fault rules come first; a request they answer does not spend a token
        rule = proxy.add_rule(s3_slowdown(method="GET", times=1))
        assert [s for s, _ in _statuses(proxy.port, "GET", ["/bkt/other/x"])] == [503]
        assert proxy.stats.rule(rule).injected == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rate": 0}, "rate"),
    ({"rate": 1, "burst": 0.5}, "burst"),
    ({"rate": 1, "depth": 0}, "depth"),
    ({"rate": 1, "answer": FaultRule(action="reset")}, "answer"),
], ids=["rate-zero", "burst-below-one", "depth-zero", "answer-not-status"])
def test_rate_limit_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PrefixRateLimit(**kwargs)


# ---------------------------------------------------------------------------------------------
# multi-rank saves through the rate limit (SeaweedFS behind the proxy)

RANKS, FILES, KIB = 4, 8, 64
RATE, BURST = 10.0, 3.0


def _throttled_save(seaweedfs: Any, react: bool) -> tuple[list[dict[str, Any]], Any, str,
                                                          dict[str, Any]]:
    store = seaweedfs.store()
    opts, proxy = store.proxied_options()
    limit = proxy.add_rate_limit(PrefixRateLimit(rate=RATE, burst=BURST))
    try:
        url = f"{store.root}/ckpt"
        out = run_ranks(RANKS, save_own_keys, url, opts, {"throttle_backoff": react}, FILES, KIB,
                        timeout=300)
        counts = proxy.stats.rate_limit(limit)
    finally:
        proxy.remove_rate_limit(limit)
    return out, counts, url, store.storage_options


@pytest.fixture(scope="module")
def throttled_on(seaweedfs: Any) -> tuple[list[dict[str, Any]], Any, str, dict[str, Any]]:
    return _throttled_save(seaweedfs, react=True)


@pytest.fixture(scope="module")
def throttled_off(seaweedfs: Any) -> tuple[list[dict[str, Any]], Any, str, dict[str, Any]]:
    return _throttled_save(seaweedfs, react=False)


def _per_part(out: list[dict[str, Any]]) -> float:
    return sum(o["retries"] for o in out) / sum(o["parts"] for o in out)


@pytest.mark.servers
def test_throttled_save_succeeds_with_bounded_retries(throttled_on) -> None:
    out, counts, url, opts = throttled_on
    assert [o["error"] for o in out] == [None] * RANKS
    assert counts.throttled > 0  # the limit did bite
    assert sum(o["throttle_cuts"] for o in out) >= 1  # ... and the ranks reacted
    assert _per_part(out) <= 2.0
    assert counts.throttled <= 2.0 * RANKS * FILES  # the proxy's count agrees
    # what was saved loads back whole (one process, every rank's keys)
    expected: dict[str, torch.Tensor] = {}
    for r in range(RANKS):
        expected.update(rank_state(r, FILES, KIB))
    state = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(state, storage_reader=VolumeReader(url, storage_options=opts), no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.servers
def test_without_the_reaction_the_same_save_retries_more(throttled_on, throttled_off) -> None:
    on_counts = throttled_on[1]
    off, off_counts = throttled_off[0], throttled_off[1]
    assert all(o["throttle_cuts"] is None for o in off)  # the switch really was off
    # the proxy's count (a rank whose save failed reports no SaveStats; the proxy sees all)
    assert off_counts.throttled > on_counts.throttled


@pytest.mark.servers
def test_a_throttled_load_paces_with_the_writers_throttle(seaweedfs: Any) -> None:
    """Downloads go through the same per-(process, store) pacer as uploads."""
    from dcp_volumes.backends import pacing

    store = seaweedfs.store()
    opts, proxy = store.proxied_options()
    expected = _single_process_state(8)
    url = f"{store.root}/ckpt-{uuid.uuid4().hex[:6]}"
    writer = VolumeWriter(url, storage_options=opts, spool=SpoolOptions(files_per_rank=8))
    dcp.save(expected, storage_writer=writer, no_dist=True)
    reader = VolumeReader(url, storage_options=opts,
                          transfer=TransferOptions(max_concurrency=8, max_range_size=5 << 20,
                                                   coalesce_gap=0))
    throttle = reader.backend().throttle
    assert throttle is not None and throttle is writer.backend().throttle
    cuts = throttle.cuts
    limit = proxy.add_rate_limit(PrefixRateLimit(rate=5, burst=2))
    try:
        state = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(state, storage_reader=reader, no_dist=True)
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        assert proxy.stats.rate_limit(limit).throttled > 0
        assert throttle.cuts > cuts and reader.last_stats is not None
        assert reader.last_stats.retries > 0
    finally:
        proxy.remove_rate_limit(limit)
        pacing._throttles.pop(throttle.key, None)  # later tests start unpaced


# ---------------------------------------------------------------------------------------------
# the hashed key layout


def _single_process_state(files: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.randn(1000 + i, generator=g) for i in range(files)}


def _hashed_writer(url: str, opts: dict[str, Any] | None = None, **kw: Any) -> VolumeWriter:
    return VolumeWriter(url, storage_options=opts, spool=SpoolOptions(files_per_rank=8),
                        transfer=TransferOptions(key_layout="hashed"), **kw)


def test_hashed_layout_on_local_disk_loads_with_torchs_own_reader(tmp_path: Path) -> None:
    from dcp_volumes import catalog

    expected = _single_process_state(8)
    url = str(tmp_path / "run" / "step-1")
    dcp.save(expected, storage_writer=_hashed_writer(url), no_dist=True)
    shards = sorted(p.relative_to(url).as_posix() for p in Path(url).rglob("*.distcp"))
    assert len(shards) == 8 and all(len(s.split("/")) == 2 for s in shards)
    assert len({s.split("/")[0] for s in shards}) >= 4  # spread over prefixes
    for reader in (VolumeReader(url), dcp.FileSystemReader(url)):
        state = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(state, storage_reader=reader, no_dist=True)
        assert all(torch.equal(state[k], v) for k, v in expected.items())
    # an overwrite replaces the hashed shards of the old save
    dcp.save(expected, storage_writer=_hashed_writer(url, overwrite=True), no_dist=True)
    assert len(list(Path(url).rglob("*.distcp"))) == 8
    # gc tells a failed save's hashed shard from the committed save's, by its save id
    stray = Path(url) / "ab" / f"__0_0-{_layout.new_save_id()}.distcp"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"left by a killed save")
    report = catalog.gc(str(tmp_path / "run"), older_than_s=0, dry_run=False)
    assert [u.rsplit("/", 2)[-2:] for u in report.leftovers] == [["ab", stray.name]]
    assert not stray.exists() and len(list(Path(url).rglob("*.distcp"))) == 8
    state = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(url), no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.servers
def test_hashed_layout_spreads_requests_and_loads_with_fsspec_reader(seaweedfs: Any) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    store = seaweedfs.store()
    opts, proxy = store.proxied_options()
    limit = proxy.add_rate_limit(PrefixRateLimit(rate=1000))  # only to count per prefix
    try:
        expected = _single_process_state(8)
        url = f"{store.root}/ckpt-{uuid.uuid4().hex[:6]}"
        dcp.save(expected, storage_writer=_hashed_writer(url, opts), no_dist=True)
        prefixes = proxy.stats.rate_limit(limit).prefixes
    finally:
        proxy.remove_rate_limit(limit)
    ckpt = url.split("://", 1)[1]
    hashed = [p for p in prefixes if p.startswith(ckpt + "/")]
    assert len(hashed) >= 4  # the shard PUTs went to several prefixes, not one
    for reader in (VolumeReader(url, storage_options=store.storage_options),
                   FsspecReader(url, **store.storage_options)):
        state = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(state, storage_reader=reader, no_dist=True)
        assert all(torch.equal(state[k], v) for k, v in expected.items())


# ---------------------------------------------------------------------------------------------
# a store that throttles every upload (issue 18 #6)

#: one request's deadline, small so that the test takes seconds; attempts are not the bound
STORM_RETRY_DEADLINE_S = 1.5


@pytest.mark.servers
def test_a_store_throttling_every_upload_fails_the_save_in_about_one_deadline(
        seaweedfs: Any) -> None:
    """Every PUT answered SlowDown: the save fails within a small multiple of
    RetryOptions.deadline_s (not one deadline per part, as it did: 249 s for 64 MiB), with an
    error that says the store kept throttling and what to change."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_volumes import RetryOptions, errors
    from dcp_volumes.backends import pacing
    from dcp_volumes.testing._suite_support import failures_of

    store = seaweedfs.store()
    opts, proxy = store.proxied_options()
    url = f"{store.root}/storm-{uuid.uuid4().hex[:6]}"
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(2 << 20, generator=g) for i in range(4)}  # 4 × 8 MiB
    writer = VolumeWriter(
        url, storage_options=opts, spool=SpoolOptions(files_per_rank=2),
        transfer=TransferOptions(part_size=5 << 20, max_concurrency=4),
        retry=RetryOptions(max_attempts=50, initial_backoff_s=0.01, max_backoff_s=0.05,
                           deadline_s=STORM_RETRY_DEADLINE_S),
    )
    throttle = writer.backend().throttle
    assert throttle is not None
    # every shard PUT (parts and single-part objects); the save's small records go through
    rule = proxy.add_rule(s3_slowdown(method="PUT", path_regex=r"\.distcp", times=None))
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.save(state, storage_writer=writer, no_dist=True)
        elapsed = time.monotonic() - started
        assert proxy.stats.rule(rule).injected > 0
    finally:
        proxy.remove_rule(rule)
        pacing._throttles.pop(throttle.key, None)  # later tests start unpaced
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.UploadError), repr(err)
    message = str(err)
    assert "kept throttling" in message and "throttle answers in a row" in message
    assert "max_concurrency" in message and "deadline_s" in message
    assert elapsed < 4 * STORM_RETRY_DEADLINE_S + 4.0, elapsed
