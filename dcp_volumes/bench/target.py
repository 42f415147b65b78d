"""Where ``dcp-volumes bench`` puts the bytes: a local server it starts or a named endpoint,
and one endpoint per network profile (the s3-like one through a proxy process)."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ProfileProxy", "Target", "open_target"]

_SECRET_OPTIONS = frozenset({"key", "secret", "token_secret", "connection_string", "account_key",
                             "sas_token", "password"})


class ProfileProxy:
    """The s3-like FaultProxy, in a child process of ours."""

    def __init__(self, upstream: str, delay: float, rate: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcp_volumes.bench.proxy", upstream, str(delay), str(rate)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"the s3-like proxy did not start (said {line!r})")
        self.endpoint_url = line.split(" ", 1)[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Target:
    """The store under test and how each profile reaches it."""

    protocol: str
    base_url: str  # e.g. s3://dcpv-bench/<run-id>
    server: Any = None  # LocalServer or None
    named_endpoint: str | None = None
    proxies: dict[str, ProfileProxy] = field(default_factory=dict)
    description: str = ""

    def endpoint(self, profile: str) -> str | None:
        if profile == "direct":
            return self.server.endpoint_url if self.server is not None else self.named_endpoint
        return self.proxies[profile].endpoint_url

    def storage_options(self, profile: str) -> dict[str, Any]:
        """Non-secret fsspec options (secrets travel in :meth:`env`)."""
        ep = self.endpoint(profile)
        if self.server is not None:
            opts = self.server.storage_options(endpoint_url=ep)
        else:
            opts = {"endpoint_url": ep} if ep else {}
        return {k: v for k, v in opts.items() if k not in _SECRET_OPTIONS}

    @property
    def speaks_s3(self) -> bool:
        """The store answers the S3 API (so S3-only contenders can run against it)."""
        from dcp_volumes.backends import backend_class
        from dcp_volumes.backends.s3 import S3Backend

        return issubclass(backend_class(f"{self.protocol}://bucket/x"), S3Backend)

    def env(self, profile: str) -> dict[str, str]:
        ep = self.endpoint(profile)
        if self.server is not None:
            return dict(self.server.env(endpoint_url=ep))
        env: dict[str, str] = {}
        if ep and self.speaks_s3:
            env.update({"AWS_ENDPOINT_URL": ep, "AWS_ENDPOINT_URL_S3": ep})
            if ep.startswith("http://"):
                env["AWS_ALLOW_HTTP"] = "true"
        return env

    def fs(self) -> Any:
        import fsspec

        opts: dict[str, Any] = (self.server.storage_options() if self.server is not None
                                else self.storage_options("direct"))
        return fsspec.filesystem(self.protocol, skip_instance_cache=True, **opts)

    def remove(self, url: str) -> None:
        with contextlib.suppress(Exception):
            fs = self.fs()
            path = url.split("://", 1)[1]
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def restart(self) -> None:
        if self.server is None:
            return
        bucket = self.base_url.split("://", 1)[1].split("/", 1)[0]
        self.server.stop()
        self.server.start()
        self.server.create_bucket(bucket)

    def close(self) -> None:
        for p in self.proxies.values():
            p.stop()
        if self.server is not None:
            self.server.stop()


@contextlib.contextmanager
def open_target(args: argparse.Namespace, run_id: str) -> Iterator[Target]:
    """The store ``args`` names (started here, or reached at ``--url``), with a proxy per
    network profile other than ``direct``; everything started is stopped on exit."""
    target: Target
    if args.endpoint_url or args.url:
        if not args.url:
            raise ValueError("--endpoint-url needs --url s3://bucket/prefix naming where to write")
        protocol = args.url.split("://", 1)[0] if "://" in args.url else ""
        if protocol not in ("s3", "gs", "az", "abfs"):
            raise ValueError(f"--url must be an s3://, gs:// or az:// URL, got {args.url!r}")
        target = Target(protocol, f"{args.url.rstrip('/')}/{run_id}",
                         named_endpoint=args.endpoint_url,
                         description=f"endpoint {args.endpoint_url or '(default for ' + protocol + ')'}")
    else:
        from dcp_volumes.testing.servers import start_server

        server = start_server(args.server)
        root = server.create_bucket("dcpv-bench")
        target = Target(server.protocol, f"{root}/{run_id}", server=server,
                         description=f"local {args.server} on 127.0.0.1")
    try:
        for profile in args.profiles:
            if profile == "direct":
                continue
            if profile != "s3-like":
                raise ValueError(f"unknown profile {profile!r}: use direct or s3-like")
            upstream = target.endpoint("direct")
            if not upstream or not upstream.startswith("http://"):
                raise ValueError("the s3-like profile needs an http:// endpoint to put its proxy "
                                 "in front of; pass --profiles direct for this store")
            target.proxies[profile] = ProfileProxy(upstream, args.first_byte_delay, args.bandwidth)
        yield target
    finally:
        target.close()


