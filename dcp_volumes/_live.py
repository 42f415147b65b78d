"""Live saves: the record that tells gc a save may still be running.

The coordinator writes it before any byte moves (:func:`mark_live`), each uploading rank
rewrites it (:class:`Heartbeat`), and it is removed once the save's outcome is decided
(:func:`end_live`). Names and the refresh interval: :mod:`dcp_volumes._layout`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from dcp_volumes import _layout
from dcp_volumes.backends import Backend, redact_url

__all__ = ["Heartbeat", "end_live", "mark_live"]

logger = logging.getLogger(__name__)


def _live_record(save_id: str) -> bytes:
    return json.dumps({"save_id": save_id, "written": time.time(),
                       "refresh_s": _layout.LIVE_REFRESH_S}).encode()


async def mark_live(backend: Backend, save_id: str) -> None:
    """Write (or rewrite) save ``save_id``'s live record (see :mod:`dcp_volumes._layout`)."""
    await backend.put(_layout.live_name(save_id), _live_record(save_id))


async def end_live(backend: Backend, save_id: str) -> None:
    """Remove a finished save's live record (best effort: gc collects a stale one)."""
    try:
        await backend.remove([_layout.live_name(save_id)])
    except Exception as exc:  # noqa: BLE001 -- the save's outcome is decided; gc tidies up
        logger.warning("could not remove the live record of save %s under %s (%s); "
                       "`dcp-volumes gc` collects it", save_id, redact_url(backend.url),
                       type(exc).__name__)


class Heartbeat:
    """Rewrites a save's live record every ``interval_s`` while one rank uploads.

    A task on the backend's event loop, so it costs one small PUT per rank per interval and
    no thread. Best effort: a failed rewrite is logged, never fails the save. :meth:`stop`
    returns only when no rewrite is in flight, so none lands after the rank's last byte.
    """

    def __init__(self, backend: Backend, save_id: str, interval_s: float | None = None) -> None:
        self.backend = backend
        self.save_id = save_id
        self.interval_s = _layout.LIVE_REFRESH_S if interval_s is None else interval_s
        self.beats = 0
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> Heartbeat:
        async def _start() -> None:
            self._stop = asyncio.Event()
            self._task = asyncio.ensure_future(self._beat(self._stop))

        self.backend.run(_start)
        return self

    async def _beat(self, stop: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await mark_live(self.backend, self.save_id)
                self.beats += 1
            except Exception as exc:  # noqa: BLE001 -- a heartbeat never fails the save
                logger.warning("could not refresh the live record of save %s under %s (%s)",
                               self.save_id, redact_url(self.backend.url), type(exc).__name__)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop rewriting; waits up to ``timeout_s`` for a rewrite in flight, then cancels it."""
        task, stop = self._task, self._stop
        if task is None or stop is None:
            return
        self._task = self._stop = None

        async def _stop() -> None:
            stop.set()
            try:
                await asyncio.wait_for(task, timeout=timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass

        self.backend.run(_stop)
