"""Ports, waiting and probing helpers, and the errors the servers raise."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "LOOPBACK",
    "ServerNotAvailableError",
    "ServerStartError",
    "free_port",
    "free_port_with_partner",
    "free_ports",
    "http_answers",
    "port_is_free",
    "venv_bin",
    "wait_until",
]

LOOPBACK = "127.0.0.1"


class ServerStartError(RuntimeError):
    """A server process exited during startup or did not answer in time."""


class ServerNotAvailableError(RuntimeError):
    """The server's program is not installed here (tests should skip, not fail)."""


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


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like the servers themselves: connections in TIME_WAIT do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port_with_partner(offset: int, exclude: set[int], attempts: int = 200) -> int:
    """Return a free port ``p`` such that ``p + offset`` is free too and neither is excluded."""
    for _ in range(attempts):
        p = free_port()
        q = p + offset
        if q < 65536 and not {p, q} & exclude and port_is_free(q):
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


def http_answers(
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


def venv_bin(name: str) -> str | None:
    """Find executable ``name`` next to ``sys.executable`` (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)
