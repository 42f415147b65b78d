"""The fault proxy itself: lifecycle, rules, counters, and one task per client connection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dcp_volumes.testing._lifecycle import LiveSet, StartStop
from dcp_volumes.testing.faultproxy._connection import Connection
from dcp_volumes.testing.faultproxy._http import MAX_HEAD
from dcp_volumes.testing.faultproxy._rules import (
    FaultRule,
    NetworkProfile,
    PrefixRateLimit,
    ProxyStats,
    RuleStats,
    _RateLimitState,
    _RuleState,
)

if TYPE_CHECKING:
    from dcp_volumes.testing.servers import LocalServer

__all__ = ["FaultProxy"]

logger = logging.getLogger(__name__)

_LIVE_PROXIES = LiveSet()


class FaultProxy(StartStop):
    """A fault-injecting HTTP/1.1 reverse proxy in front of one upstream server.

    Args:
        upstream: The server: a :class:`~dcp_volumes.testing.servers.LocalServer` (running),
            or a base URL ``http://host:port`` (any path is ignored).
        host: Interface to listen on.
        port: Port to listen on; 0 picks a free one.
        profile: Network profile; default: none (full speed, no delay).
        connect_timeout: Seconds to wait when connecting to the upstream.
    """

    def __init__(
        self,
        upstream: str | LocalServer,
        /,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        profile: NetworkProfile | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self._server_obj: LocalServer | None = None
        if isinstance(upstream, str):
            url = upstream
        else:
            self._server_obj = upstream
            url = upstream.endpoint_url
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(
                f"upstream must be an http://host:port URL or a LocalServer, got {url!r}"
            )
        self.upstream_host: str = parsed.hostname
        self.upstream_port: int = parsed.port or 80
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self._profile = profile or NetworkProfile()
        self._rules: list[_RuleState] = []
        self._rate_limits: list[_RateLimitState] = []
        self._throttled = 0
        self._lock = threading.Lock()
        self._connections = 0
        self._active = 0
        self._requests = 0
        self._faults = 0
        self._log: list[tuple[str, str]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._aserver: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy (valid after :meth:`start`)."""
        if self._thread is None:
            raise RuntimeError("FaultProxy is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def upstream_url(self) -> str:
        """Base URL of the upstream server."""
        return f"http://{self.upstream_host}:{self.upstream_port}"

    def start(self) -> None:
        """Start listening (in a background thread). Does nothing if already running."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        started: dict[str, BaseException | None] = {"error": None}
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._aserver = loop.run_until_complete(
                    asyncio.start_server(
                        self._handle, self.host, self.port, limit=MAX_HEAD, backlog=1024
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - start() re-raises it in its thread
                started["error"] = exc
                ready.set()
                loop.close()
                return
            self.port = self._aserver.sockets[0].getsockname()[1]
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        thread = threading.Thread(target=run, name=f"FaultProxy->{self.upstream_url}", daemon=True)
        thread.start()
        ready.wait()
        if started["error"] is not None:
            thread.join()
            raise started["error"]
        self._loop = loop
        self._thread = thread
        _LIVE_PROXIES.add(self)
        logger.info("fault proxy %s -> %s", self.endpoint_url, self.upstream_url)

    def stop(self) -> None:
        """Close the listener and every connection, and end the thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError, TimeoutError, asyncio.CancelledError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = None
        self._loop = None
        _LIVE_PROXIES.discard(self)

    async def _shutdown(self) -> None:
        if self._aserver is not None:
            self._aserver.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __repr__(self) -> str:
        where = f"http://{self.host}:{self.port}" if self._thread else "stopped"
        return f"<FaultProxy {where} -> {self.upstream_url}>"

    # -- client configuration --------------------------------------------------------------

    def storage_options(self) -> dict[str, Any]:
        """The upstream server's fsspec options, pointed at the proxy (needs a LocalServer)."""
        return self._require_server().storage_options(endpoint_url=self.endpoint_url)

    def env(self) -> dict[str, str]:
        """The upstream server's environment variables, pointed at the proxy."""
        return self._require_server().env(endpoint_url=self.endpoint_url)

    def _require_server(self) -> LocalServer:
        if self._server_obj is None:
            raise RuntimeError(
                "FaultProxy was given a URL, not a LocalServer; build options yourself"
            )
        return self._server_obj

    # -- rules, profile, stats -------------------------------------------------------------

    def add_rule(self, rule: FaultRule) -> FaultRule:
        """Install ``rule`` after the existing ones and return it (to look up its stats)."""
        with self._lock:
            self._rules.append(_RuleState(rule))
        return rule

    def remove_rule(self, rule: FaultRule) -> None:
        """Uninstall ``rule`` (by identity); does nothing if it is not installed."""
        with self._lock:
            self._rules = [s for s in self._rules if s.rule is not rule]

    def clear_rules(self) -> None:
        """Uninstall every rule (their stats go with them)."""
        with self._lock:
            self._rules = []

    def add_rate_limit(self, limit: PrefixRateLimit) -> PrefixRateLimit:
        """Install a per-prefix request-rate limit (after the existing ones) and return it.

        A request goes through every installed limit that applies to it; the first one that
        has no token left for its prefix answers it (503 SlowDown by default).
        """
        with self._lock:
            self._rate_limits.append(_RateLimitState(limit))
        return limit

    def remove_rate_limit(self, limit: PrefixRateLimit) -> None:
        """Uninstall ``limit`` (by identity); does nothing if it is not installed."""
        with self._lock:
            self._rate_limits = [s for s in self._rate_limits if s.limit is not limit]

    def clear_rate_limits(self) -> None:
        """Uninstall every rate limit (their stats go with them)."""
        with self._lock:
            self._rate_limits = []

    @property
    def profile(self) -> NetworkProfile:
        """The network profile; assign a new :class:`NetworkProfile` to change it."""
        return self._profile

    @profile.setter
    def profile(self, profile: NetworkProfile | None) -> None:
        self._profile = profile or NetworkProfile()

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        with self._lock:
            return ProxyStats(
                connections=self._connections,
                active_connections=self._active,
                requests=self._requests,
                faults_injected=self._faults,
                rules=tuple(RuleStats(s.rule, s.matched, s.injected) for s in self._rules),
                throttled=self._throttled,
                rate_limits=tuple(s.snapshot() for s in self._rate_limits),
            )

    def reset_stats(self) -> None:
        """Zero the global, per-rule and per-rate-limit counters (token buckets keep their
        state)."""
        with self._lock:
            self._connections = self._requests = self._faults = self._throttled = 0
            for state in self._rules:
                state.matched = state.injected = 0
            for limit in self._rate_limits:
                limit.reset()

    def record_requests(self) -> None:
        """Start (or restart) a log of every request that reaches the proxy, as
        ``(method, target)``: requests counted at the store, by what arrived there."""
        with self._lock:
            self._log = []

    def recorded_requests(self) -> list[tuple[str, str]]:
        """The requests logged since :meth:`record_requests` (empty when not recording)."""
        with self._lock:
            return list(self._log or [])

    def _select(self, method: str, target: str, fields: Mapping[str, str]) -> FaultRule | None:
        """The rule that answers this request: a fault rule, else a rate limit's answer."""
        with self._lock:
            self._requests += 1
            if self._log is not None:
                self._log.append((method, target))
            for state in self._rules:
                if state.take(method, target, fields):
                    self._faults += 1
                    return state.rule
            for limit in self._rate_limits:
                if limit.take(method, target) is False:
                    self._throttled += 1
                    return limit.limit.answer
        return None

    # -- per connection --------------------------------------------------------------------

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self._connections += 1
            self._active += 1
        conn = Connection(self, creader, cwriter)
        try:
            await conn.serve()
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - one broken connection must not stop the proxy
            logger.debug("fault proxy connection ended: %r", exc)
        finally:
            conn.close()
            with self._lock:
                self._active -= 1
            self._tasks.discard(task)
