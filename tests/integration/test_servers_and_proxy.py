"""Tests for dcp_volumes.testing.servers (real local servers) and the fault-injecting proxy.

Every server starts at most once per session (lazily, on first use) and all of them are stopped
together at the end. Data is kept small; the whole module runs in well under a minute.
"""

from __future__ import annotations

# servers must be imported before anything imports gcsfs (it sets the gcsfs env switch).
from dcp_volumes.testing import servers as srv  # isort: skip

import concurrent.futures
import http.client
import http.server
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from dcp_volumes.testing.faultproxy import (
    FaultProxy,
    FaultRule,
    NetworkProfile,
    azure_throttled,
    gcs_rate_limited,
    s3_slowdown,
)

pytestmark = pytest.mark.servers

SERVER_NAMES = ["seaweedfs", "moto", "fake-gcs", "azurite"]
AZURITE_MISSING = "Azurite not installed: run scripts/install_azurite.sh (needs node + npm)"


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def server_pool() -> Iterator[Callable[[str], srv.LocalServer]]:
    """Start servers on first use; stop all of them (in parallel) at the end of the session."""
    started: dict[str, srv.LocalServer] = {}
    lock = threading.Lock()

    def get(name: str) -> srv.LocalServer:
        with lock:
            if name not in started:
                if name == "azurite" and not srv.AzuriteServer.available():
                    pytest.skip(AZURITE_MISSING)
                started[name] = srv.start_server(name)
            return started[name]

    yield get
    with concurrent.futures.ThreadPoolExecutor(max(1, len(started))) as pool:
        list(pool.map(lambda s: s.stop(), started.values()))


@pytest.fixture(params=SERVER_NAMES, ids=SERVER_NAMES)
def server(
    request: pytest.FixtureRequest, server_pool: Callable[[str], srv.LocalServer]
) -> srv.LocalServer:
    return server_pool(request.param)


@pytest.fixture
def seaweedfs(server_pool: Callable[[str], srv.LocalServer]) -> srv.LocalServer:
    return server_pool("seaweedfs")


@pytest.fixture
def s3_proxy(seaweedfs: srv.LocalServer) -> Iterator[FaultProxy]:
    """A fresh proxy (no rules, zeroed stats) in front of the session's SeaweedFS."""
    seaweedfs.create_bucket("proxied")
    with FaultProxy(seaweedfs) as proxy:
        yield proxy


def s3fs_via(proxy: FaultProxy, **extra: Any) -> Any:
    """An uncached s3fs filesystem talking to ``proxy``."""
    return fsspec.filesystem("s3", skip_instance_cache=True, **proxy.storage_options(), **extra)


def fast_retry_s3fs(proxy: FaultProxy) -> Any:
    """s3fs whose retries are its own quick loop (0.1 s, 0.17 s, ...) rather than botocore's."""
    return s3fs_via(proxy, config_kwargs={"retries": {"max_attempts": 1}})


# ---------------------------------------------------------------------------------------------
# servers


def test_server_roundtrip(server: srv.LocalServer) -> None:
    root = server.create_bucket("roundtrip")
    assert root == f"{server.protocol}://roundtrip"
    assert server.create_bucket("roundtrip") == root  # exist_ok by default
    fs = fsspec.filesystem(server.protocol, skip_instance_cache=True, **server.storage_options())
    payload = os.urandom(100_000)
    fs.pipe(f"{root}/dir/obj.bin", payload)
    assert fs.cat(f"{root}/dir/obj.bin") == payload
    assert fs.info(f"{root}/dir/obj.bin")["size"] == len(payload)
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/dir", detail=False)] == ["obj.bin"]
    fs.rm(f"{root}/dir/obj.bin")
    assert not fs.exists(f"{root}/dir/obj.bin")


def test_server_config_shape(server: srv.LocalServer) -> None:
    assert server.running and server.pid is not None
    assert server.endpoint_url.startswith("http://127.0.0.1:")
    opts, env = server.storage_options(), server.env()
    if server.protocol == "s3":
        assert set(opts) == {"key", "secret", "endpoint_url", "client_kwargs"}
        assert opts["client_kwargs"] == {} and opts["endpoint_url"] == server.endpoint_url
        assert env["AWS_ENDPOINT_URL"] == server.endpoint_url
        assert env["AWS_ACCESS_KEY_ID"] == opts["key"]
    elif server.protocol == "gs":
        assert opts == {"endpoint_url": server.endpoint_url, "token": "anon"}
        assert env["STORAGE_EMULATOR_HOST"] == server.endpoint_url
    else:
        assert f"BlobEndpoint={server.endpoint_url}/devstoreaccount1" in opts["connection_string"]
        assert env["AZURE_STORAGE_CONNECTION_STRING"] == opts["connection_string"]
    moved = server.storage_options(endpoint_url="http://127.0.0.1:1")
    assert "http://127.0.0.1:1" in str(moved) and server.endpoint_url not in str(moved)
    assert str(opts.get("secret", "no-secret")) not in repr(server) and server.log_path.is_file()


def test_server_listens_on_loopback_only(server: srv.LocalServer) -> None:
    psutil = pytest.importorskip("psutil")
    assert server.pid is not None

    def listening() -> list:
        return [
            c.laddr
            for c in psutil.Process(server.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]

    if isinstance(server, srv.SeaweedFSServer):
        # weed mini answers on S3 before its other components (admin, workers) listen.
        want = set(server.ports.values())
        srv.wait_until(lambda: {a.port for a in listening()} >= want, 20.0,
                       "every SeaweedFS component listening")
    addrs = listening()
    assert addrs and all(addr.ip == "127.0.0.1" for addr in addrs), addrs


def test_moto_lifecycle_reset_and_restart() -> None:
    server = srv.MotoServer()
    server.start()
    try:
        pid, workdir, url = server.pid, server.workdir, server.endpoint_url
        server.start()  # no-op while running
        assert server.pid == pid
        root = server.create_bucket("to-reset")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options())
        fs.pipe(f"{root}/k", b"v")
        server.reset()
        fs.invalidate_cache()
        assert not fs.exists(root)
        server.stop()
        server.stop()  # idempotent
        assert server.pid is None and not server.running and not workdir.exists()
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0
        server.start()  # a restart keeps the endpoint and credentials
        assert server.endpoint_url == url and server.pid != pid
        assert server.create_bucket("after-restart") == "s3://after-restart"
    finally:
        server.stop()


def test_start_failure_reports_log_tail(tmp_path: Path) -> None:
    script = tmp_path / "dies.sh"
    script.write_text("#!/bin/sh\necho 'bind: address already in use (simulated)'\nexit 3\n")
    script.chmod(0o755)
    server = srv.FakeGCSServer(binary=str(script), start_attempts=2, startup_timeout=5)
    with pytest.raises(srv.ServerStartError, match=r"(?s)exited with code 3.*simulated"):
        server.start()
    assert not server.running


def test_a_server_that_hangs_at_startup_is_retried_on_new_ports(tmp_path: Path) -> None:
    """A first process that never answers is killed and a fresh one started (it used to
    fail the whole session's fixture on one hang)."""
    marker = tmp_path / "hung-once"
    script = tmp_path / "hangs-once.sh"
    script.write_text(f"#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}; exec sleep 60; fi\n"
                      "echo 'second try (simulated)'\nexit 4\n")
    script.chmod(0o755)
    server = srv.FakeGCSServer(binary=str(script), start_attempts=2, startup_timeout=2)
    with pytest.raises(srv.ServerStartError, match=r"(?s)exited with code 4.*second try"):
        server.start()  # the second attempt ran (and, being a script, exited)
    assert marker.exists() and not server.running


def test_import_sets_client_environment() -> None:
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert os.environ["AWS_DEFAULT_REGION"]


def test_unknown_server_name() -> None:
    with pytest.raises(ValueError, match="unknown server"):
        srv.start_server("minio")
    assert set(srv.SERVERS) == set(SERVER_NAMES)


def test_wait_until_times_out_with_message() -> None:
    with pytest.raises(TimeoutError, match="the moon turns blue"):
        srv.wait_until(lambda: False, 0.2, "the moon turns blue")
    ports = srv.free_ports(5)
    assert len(set(ports)) == 5


# ---------------------------------------------------------------------------------------------
# proxy against SeaweedFS (validates SigV4, so Host must pass through unchanged)


def test_proxy_passthrough_s3(s3_proxy: FaultProxy) -> None:
    parts = s3_proxy.add_rule(FaultRule(action="delay", path_regex=r"partNumber=", times=None))
    fs = s3fs_via(s3_proxy)
    fs.pipe("s3://proxied/small", b"hello")
    assert fs.cat("s3://proxied/small") == b"hello"
    big = os.urandom(6 * 2**20)
    with fs.open("s3://proxied/multipart", "wb", block_size=5 * 2**20) as f:
        f.write(big)
    assert fs.cat("s3://proxied/multipart") == big
    stats = s3_proxy.stats
    assert stats.rule(parts).injected >= 1  # UploadPart requests, matched on the query string
    assert stats.requests >= 6
    assert stats.connections < stats.requests  # keep-alive connections are reused


def test_proxy_503_is_retried(s3_proxy: FaultProxy) -> None:
    fs = fast_retry_s3fs(s3_proxy)
    rule = s3_proxy.add_rule(s3_slowdown(method="PUT", path_regex=r"partNumber=", times=3))
    data = os.urandom(6 * 2**20)
    with fs.open("s3://proxied/slow", "wb", block_size=5 * 2**20) as f:
        f.write(data)
    assert s3_proxy.stats.rule(rule).injected == 3
    assert s3_proxy.stats.faults_injected == 3
    assert fs.cat("s3://proxied/slow") == data


def test_proxy_reset_is_a_connection_error(s3_proxy: FaultProxy) -> None:
    fs = fast_retry_s3fs(s3_proxy)
    fs.pipe("s3://proxied/r", b"data")
    rule = s3_proxy.add_rule(
        FaultRule(action="reset", method="GET", path_regex=r"^/proxied/r$", times=None)
    )
    fs.retries = 2
    with pytest.raises(Exception) as info:
        fs.cat("s3://proxied/r")
    chain = [info.value, info.value.__context__, info.value.__cause__]
    assert any(
        isinstance(e, ConnectionError) or "Connect" in type(e).__name__ for e in chain if e
    ), repr(info.value)
    assert s3_proxy.stats.rule(rule).injected >= 2
    s3_proxy.clear_rules()
    assert fs.cat("s3://proxied/r") == b"data"


def test_proxy_reset_twice_then_recovers(s3_proxy: FaultProxy) -> None:
    fs = fast_retry_s3fs(s3_proxy)
    fs.pipe("s3://proxied/r2", b"data2")
    rule = s3_proxy.add_rule(FaultRule(action="reset", method="GET", times=2))
    assert fs.cat("s3://proxied/r2") == b"data2"
    assert s3_proxy.stats.rule(rule).injected == 2


def test_proxy_truncate_and_fail_after_bytes_are_retried(s3_proxy: FaultProxy) -> None:
    fs = fast_retry_s3fs(s3_proxy)
    data = os.urandom(300_000)
    cut_upload = s3_proxy.add_rule(
        FaultRule(action="fail_after_bytes", method="PUT", nbytes=50_000)
    )
    fs.pipe("s3://proxied/cut", data)
    cut_download = s3_proxy.add_rule(FaultRule(action="truncate", method="GET", nbytes=1000))
    assert fs.cat("s3://proxied/cut") == data
    stats = s3_proxy.stats
    assert stats.rule(cut_upload).injected == 1 and stats.rule(cut_download).injected == 1


def test_proxy_delay_and_first_byte_delay(s3_proxy: FaultProxy) -> None:
    fs = s3fs_via(s3_proxy)
    fs.pipe("s3://proxied/d", b"x")
    s3_proxy.add_rule(FaultRule(action="delay", method="GET", delay_s=0.4))
    t0 = time.monotonic()
    fs.cat("s3://proxied/d")
    assert time.monotonic() - t0 >= 0.35
    s3_proxy.clear_rules()
    s3_proxy.profile = NetworkProfile(first_byte_delay_s=0.3)
    t0 = time.monotonic()
    fs.cat("s3://proxied/d")
    assert time.monotonic() - t0 >= 0.25


def test_proxy_bandwidth_cap(s3_proxy: FaultProxy) -> None:
    fs = s3fs_via(s3_proxy)
    data = os.urandom(2_000_000)
    fs.pipe("s3://proxied/bw", data)
    s3_proxy.profile = NetworkProfile(per_connection_bytes_per_s=1_000_000)
    t0 = time.monotonic()
    assert fs.cat("s3://proxied/bw") == data
    assert time.monotonic() - t0 >= 1.5


def test_proxy_many_concurrent_requests(s3_proxy: FaultProxy) -> None:
    fs = s3fs_via(s3_proxy)
    blobs = {f"proxied/many/{i:03d}": os.urandom(1000 + i) for i in range(64)}
    fs.pipe(blobs)
    assert fs.cat(list(blobs)) == blobs
    assert s3_proxy.stats.active_connections <= s3_proxy.stats.connections


# ---------------------------------------------------------------------------------------------
# proxy against the GCS and Azure emulators


def test_proxy_gcs_resumable_upload_and_429(server_pool: Callable[[str], srv.LocalServer]) -> None:
    server = server_pool("fake-gcs")
    root = server.create_bucket("gcs-proxied")
    with FaultProxy(server) as proxy:
        fs = fsspec.filesystem("gs", skip_instance_cache=True, **proxy.storage_options())
        data = os.urandom(600 * 1024)
        # > block_size: a resumable upload whose Location the proxy must point back at itself.
        with fs.open(f"{root}/big", "wb", block_size=256 * 1024) as f:
            f.write(data)
        assert fs.cat(f"{root}/big") == data
        rule = proxy.add_rule(gcs_rate_limited(method="POST", times=1))
        fs.pipe(f"{root}/small", b"abc")
        assert proxy.stats.rule(rule).injected == 1
        assert fs.cat(f"{root}/small") == b"abc"


def test_proxy_azure_passthrough_and_throttle(
    server_pool: Callable[[str], srv.LocalServer],
) -> None:
    from azure.core.exceptions import HttpResponseError

    server = server_pool("azurite")
    root = server.create_bucket("az-proxied")
    with FaultProxy(server) as proxy:
        fs = fsspec.filesystem("az", skip_instance_cache=True, **proxy.storage_options())
        fs.pipe(f"{root}/a", b"azure")
        assert fs.cat(f"{root}/a") == b"azure"
        # 429: azure-storage-blob does not retry it (a 503 would be retried after ~15 s).
        rule = proxy.add_rule(azure_throttled(method="PUT", status=429, times=1))
        with pytest.raises(HttpResponseError, match="ServerBusy"):
            fs.pipe(f"{root}/b", b"x")
        assert proxy.stats.rule(rule).injected == 1


# ---------------------------------------------------------------------------------------------
# HTTP framing edge cases against a tiny in-process upstream


class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            out = b""
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return out
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _reply(self, body: bytes, *, head: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Host", self.headers.get("Host", ""))
        self.send_header("X-Expect", self.headers.get("Expect", ""))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_PUT(self) -> None:
        self._reply(b"got:" + self._body())

    def do_GET(self) -> None:
        if self.path == "/close":  # close-delimited body, no Content-Length
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"until-eof")
            self.close_connection = True
            return
        self._reply(self.path.encode())

    def do_HEAD(self) -> None:
        self._reply(b"0123456789", head=True)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 128  # the default of 5 drops connections under concurrency

    httpd = Server(("127.0.0.1", 0), _Echo)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_proxy_http_framing(echo_url: str) -> None:
    with FaultProxy(echo_url) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        # chunked request body + Expect: 100-continue answered by the proxy
        conn.request(
            "PUT",
            "/c",
            body=iter([b"ab", b"cd"]),
            encode_chunked=True,
            headers={"Expect": "100-continue", "Host": "example.test:9"},
        )
        resp = conn.getresponse()
        assert resp.read() == b"got:abcd"
        assert resp.getheader("X-Host") == "example.test:9"  # Host passes through unchanged
        assert resp.getheader("X-Expect") == ""
        conn.request("HEAD", "/h")  # same connection: HEAD has Content-Length but no body
        resp = conn.getresponse()
        assert resp.getheader("Content-Length") == "10" and resp.read() == b""
        conn.request("GET", "/close")
        assert conn.getresponse().read() == b"until-eof"
        conn.close()
        # two pipelined requests in one write
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\nGET /two HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while received.count(b"HTTP/1.1 200") < 2 or not received.endswith(b"/two"):
                chunk = s.recv(65536)
                assert chunk
                received += chunk
        assert received.index(b"/one") < received.index(b"/two")
        assert proxy.stats.requests == 5 and proxy.stats.faults_injected == 0


def test_proxy_rule_matching(echo_url: str) -> None:
    with FaultProxy(echo_url) as proxy:
        teapot = proxy.add_rule(
            FaultRule(
                action="status",
                status=418,
                body="short and stout",
                method="get",
                path_regex=r"^/tea",
                header=("X-Kind", "^green$"),
                skip=1,
                times=2,
            )
        )

        def get(path: str, kind: str = "green") -> int:
            req = urllib.request.Request(proxy.endpoint_url + path, headers={"X-Kind": kind})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        assert [
            get("/tea"),
            get("/tea"),
            get("/tea", "black"),
            get("/coffee"),
            get("/tea"),
            get("/tea"),
        ] == [
            200,
            418,
            200,
            200,
            418,
            200,
        ]
        assert (proxy.stats.rule(teapot).matched, proxy.stats.rule(teapot).injected) == (4, 2)
        proxy.reset_stats()
        assert proxy.stats.requests == 0 and proxy.stats.rule(teapot).injected == 0
        proxy.remove_rule(teapot)
        with pytest.raises(KeyError):
            proxy.stats.rule(teapot)
    with pytest.raises(ValueError, match="nbytes"):
        FaultRule(action="fail_after_bytes")
    with pytest.raises(ValueError, match="action"):
        FaultRule(action="explode")  # type: ignore[arg-type]


def test_writer_goes_wide_on_a_far_store_and_records_it(s3_proxy: FaultProxy) -> None:
    """Through a 40 ms first-byte delay the first small request (the multipart set-up) is
    slow, so the save starts at max_concurrency; the figures say so."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import TransferOptions, VolumeReader, VolumeWriter
    from dcp_volumes._compat import no_dist

    s3_proxy.profile = NetworkProfile(first_byte_delay_s=0.04)
    state = {"w": torch.randn(3 << 20)}  # 12 MiB: a multipart file of 5 MiB parts
    url = "s3://proxied/adaptive-far"
    opts = s3_proxy.storage_options()
    writer = VolumeWriter(url, storage_options=opts,
                          transfer=TransferOptions(part_size=5 << 20, max_concurrency=12))
    dcp.save(state, storage_writer=writer, **no_dist())
    assert writer.last_stats is not None
    assert writer.last_stats.concurrency == (2, 12)
    out = {"w": torch.zeros(3 << 20)}
    dcp.load(out, storage_reader=VolumeReader(url, storage_options=opts), **no_dist())
    assert torch.equal(out["w"], state["w"])
