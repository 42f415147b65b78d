"""Azurite's Blob service, with the published development account."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, ClassVar

from dcp_volumes.testing.servers._base import LocalServer
from dcp_volumes.testing.servers._util import LOOPBACK, ServerNotAvailableError, http_answers

__all__ = ["AZURITE_ACCOUNT_KEY", "AZURITE_ACCOUNT_NAME", "AzuriteServer"]

#: The published Azurite development account (documented by Microsoft; not a secret).
AZURITE_ACCOUNT_NAME = "devstoreaccount1"
#: The published key of :data:`AZURITE_ACCOUNT_NAME` (documented by Microsoft; not a secret).
AZURITE_ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_REPO_ROOT = Path(__file__).resolve().parents[3]


class AzuriteServer(LocalServer):
    """Azurite's Blob service (``azurite-blob``), run directly with node.

    Install it with ``scripts/install_azurite.sh`` (into ``<repo>/.tools/azurite``) or point
    ``DCP_VOLUMES_AZURITE_BIN`` at an ``azurite-blob`` script. It is run as ``node <script>``
    rather than through ``npx``, whose wrapper PID is not the server's.

    Args:
        binary: Path to ``azurite-blob``; default: ``$DCP_VOLUMES_AZURITE_BIN``, else
            ``<repo>/.tools/azurite/node_modules/.bin/azurite-blob``, else ``azurite-blob``
            on ``PATH``.
        node: The node executable; default: ``node`` on ``PATH``.
        **kwargs: See :class:`LocalServer`.
    """

    name: ClassVar[str] = "azurite"
    protocol: ClassVar[str] = "az"

    def __init__(
        self, *, binary: str | None = None, node: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._binary = binary
        self._node = node

    @staticmethod
    def find_binary() -> str:
        """Locate ``azurite-blob`` (see the class docstring for the search order)."""
        candidates = [
            os.environ.get("DCP_VOLUMES_AZURITE_BIN"),
            str(_REPO_ROOT / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"),
            shutil.which("azurite-blob"),
        ]
        for candidate in candidates:
            if candidate and Path(candidate).is_file():
                return candidate
        raise ServerNotAvailableError(
            "azurite-blob not found (looked at $DCP_VOLUMES_AZURITE_BIN, "
            f"{_REPO_ROOT / '.tools/azurite/node_modules/.bin/azurite-blob'} and PATH); "
            "run scripts/install_azurite.sh"
        )

    @classmethod
    def available(cls) -> bool:
        """True when both node and ``azurite-blob`` can be found."""
        try:
            cls.find_binary()
        except ServerNotAvailableError:
            return False
        return shutil.which("node") is not None

    @property
    def account_url(self) -> str:
        """Blob endpoint of the development account, ``http://127.0.0.1:PORT/devstoreaccount1``."""
        return f"{self.endpoint_url}/{AZURITE_ACCOUNT_NAME}"

    def connection_string(self, *, endpoint_url: str | None = None) -> str:
        """Connection string for the published development account."""
        base = self._endpoint(endpoint_url)
        return (
            "DefaultEndpointsProtocol=http;"
            f"AccountName={AZURITE_ACCOUNT_NAME};"
            f"AccountKey={AZURITE_ACCOUNT_KEY};"
            f"BlobEndpoint={base}/{AZURITE_ACCOUNT_NAME};"
        )

    def _command(self, workdir: Path) -> list[str]:
        node = self._node or shutil.which("node")
        if node is None:
            raise ServerNotAvailableError("node not found on PATH (needed to run Azurite)")
        (workdir / "data").mkdir(exist_ok=True)
        return [
            node,
            self._binary or self.find_binary(),
            "--blobHost",
            LOOPBACK,
            "--blobPort",
            str(self.port),
            "--location",
            str(workdir / "data"),
            "--skipApiVersionCheck",
            "--loose",
            "--disableTelemetry",
        ]

    def _is_ready(self) -> bool:
        # Any HTTP answer (an unauthenticated request gets an error status) means it serves.
        return http_answers(f"{self.account_url}?comp=list")

    def storage_options(self, *, endpoint_url: str | None = None) -> dict[str, Any]:
        """adlfs options: ``{"connection_string": ...}`` for the development account."""
        return {"connection_string": self.connection_string(endpoint_url=endpoint_url)}

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """Azure SDK / adlfs / obstore variables for the development account."""
        base = self._endpoint(endpoint_url)
        return {
            "AZURE_STORAGE_CONNECTION_STRING": self.connection_string(endpoint_url=base),
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT_NAME,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_ACCOUNT_KEY,
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": base,
        }
