"""The base class of every local server: a child process on loopback ports, in its own workdir."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from dcp_volumes.testing._lifecycle import LiveSet, StartStop
from dcp_volumes.testing.servers._util import (
    LOOPBACK,
    ServerStartError,
    free_port,
    port_is_free,
    wait_until,
)

__all__ = ["LocalServer"]

logger = logging.getLogger(__name__)

if "gcsfs" in sys.modules and "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT" not in os.environ:
    logger.warning(
        "gcsfs was imported before dcp_volumes.testing.servers without "
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; gcsfs calls to fake-gcs-server may stall. "
        "Set the variable before importing gcsfs."
    )
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

_LOG_NAME = "server.log"
_LOG_TAIL_BYTES = 4000

_LIVE_SERVERS = LiveSet()


class LocalServer(StartStop):
    """A local object-store server in a child process, bound to 127.0.0.1.

    Subclasses set :attr:`name` and :attr:`protocol` and implement :meth:`_command`,
    :meth:`_is_ready`, :meth:`storage_options` and :meth:`env`.

    Args:
        startup_timeout: Seconds to wait for the server to answer before giving up.
        stop_timeout: Seconds to wait after SIGTERM before sending SIGKILL.
        start_attempts: Startup is retried on fresh ports this many times in total when the
            process exits early (typically because another process took a chosen port) or
            does not answer within ``startup_timeout`` (it is killed first).
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
        return self._local_url

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
        return self.workdir / _LOG_NAME

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
                    if attempt == self.start_attempts:
                        raise
                    # a server that hung at startup (seen once: weed mini silent for 60 s on
                    # a busy machine) gets a fresh process on fresh ports, as one that exited
                    logger.warning(
                        "%s %s during startup (attempt %d/%d); retrying on new ports",
                        self.name,
                        "exited" if exited else "did not answer",
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
            _LIVE_SERVERS.discard(self)

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
            with open(self._workdir / _LOG_NAME, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = f"pid={self.pid} endpoint={self.endpoint_url}" if self.running else "stopped"
        return f"<{type(self).__name__} {self.name} {state}>"

    # -- for subclasses --------------------------------------------------------------------

    def _allocate_ports(self) -> None:
        """Choose ports for this attempt (sets ``self.port`` and any others)."""
        self.port = free_port()

    def _previous_ports_free(self) -> bool:
        """True when the ports of an earlier run can be used again (a restart keeps its URL)."""
        return self.port != 0 and port_is_free(self.port)

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

    @property
    def _local_url(self) -> str:
        """``http://127.0.0.1:PORT``, also while starting (before :attr:`endpoint_url` is valid)."""
        return f"http://{LOOPBACK}:{self.port}"

    def _endpoint(self, endpoint_url: str | None) -> str:
        """``endpoint_url`` when given (a proxy in front), else the server's own."""
        return endpoint_url or self.endpoint_url

    def _start_once(self, *, reuse_ports: bool) -> None:
        if not (reuse_ports and self._previous_ports_free()):
            self._allocate_ports()
        workdir = Path(tempfile.mkdtemp(prefix=f"dcp-volumes-{self.name}-"))
        self._workdir = workdir
        self._prepare(workdir)
        argv = self._command(workdir)
        t0 = time.monotonic()
        proc = self._spawn(argv, workdir)
        self._wait_ready(proc)
        self.start_seconds = time.monotonic() - t0
        logger.info(
            "%s ready at http://%s:%d (pid %d) in %.2fs",
            self.name,
            LOOPBACK,
            self.port,
            proc.pid,
            self.start_seconds,
        )

    def _spawn(self, argv: list[str], workdir: Path) -> subprocess.Popen[bytes]:
        """Start the process, output to the log in ``workdir``; stopped at exit if still alive."""
        env = {**os.environ, **self.child_env, **self._child_env(workdir)}
        self._log_file = open(workdir / _LOG_NAME, "ab")  # noqa: SIM115 - closed in _cleanup
        self._proc = proc = subprocess.Popen(
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
        _LIVE_SERVERS.add(self)
        logger.debug("started %s pid %d: %s", self.name, proc.pid, argv[0])
        return proc

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait until the server answers; :class:`ServerStartError` if it exits or times out."""

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

    def _cleanup(self) -> None:
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None
        self._extra_cleanup()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
