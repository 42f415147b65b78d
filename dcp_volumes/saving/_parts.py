"""Parts of a spool file on their way to the store: :class:`SpooledPart` (a part and where
its bytes are) and :class:`PartStream` (the parts of one file, in order, from the thread
that serializes it to the event loop that uploads them).

The stream is the seam between the two halves of a save: the spool puts parts in and never
waits for the network; the uploader takes them out with ``async for``. A failed upload
cancels the stream, and the spool's next :meth:`PartStream.put` raises that failure, so
serialization stops early.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dcp_volumes.backends.sink import Part

__all__ = ["PartStream", "SpooledPart"]


@dataclass
class SpooledPart:
    """A part of a spool file: what the store's sink receives (:attr:`part`), and its bytes,
    held in memory (:attr:`buffer`, memory mode) or read back from the spool file by
    :meth:`read` (disk mode) into a buffer that :meth:`done` gives back (``recycle``)."""

    part: Part
    buffer: bytearray | memoryview | None = None
    reader: Callable[[int, int], bytes | memoryview] | None = None
    release: Callable[[], None] | None = None
    recycle: Callable[[memoryview], None] | None = None
    _held: memoryview | None = None

    def read(self) -> bytes | bytearray | memoryview:
        """The part's bytes, with no copy in memory mode (the buffer itself) nor in disk
        mode (a view of the buffer read back into, valid until :meth:`done`)."""
        if self.buffer is not None:
            return self.buffer
        if self.part.length == 0 or self.reader is None:
            return b""
        data = self.reader(self.part.offset, self.part.length)
        if isinstance(data, memoryview) and self.recycle is not None:
            self._held = data
        return data

    def done(self) -> None:
        """Free the part's buffer slot (memory mode) or read-back buffer (disk mode); safe
        to call twice."""
        self.buffer = None
        if self.release is not None:
            release, self.release = self.release, None
            release()
        held, self._held = self._held, None
        if held is not None and self.recycle is not None:
            self.recycle(held)


class PartStream:
    """The parts of one spool file, from its serializing thread to the uploader's loop.

    The producer calls :meth:`put` and :meth:`end` (neither waits); the consumer iterates
    with ``async for``. :meth:`cancel` ends the stream from either side: parts not taken
    yet are freed, the consumer stops, and the producer's next :meth:`put` (or
    :meth:`check`) raises the given error.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backlog: deque[SpooledPart | None] = deque()  # None: the end
        self._wake: Callable[[], None] | None = None
        self._failure: BaseException | None = None

    # ---- the producer (the thread that spools the file) --------------------------------
    def put(self, part: SpooledPart) -> None:
        self.check()
        self._push(part)

    def end(self) -> None:
        """No part follows."""
        self._push(None)

    def check(self) -> None:
        """Raise the failure that cancelled the stream, if one did."""
        if self._failure is not None:
            raise self._failure

    def _push(self, item: SpooledPart | None) -> None:
        with self._lock:
            self._backlog.append(item)
            wake = self._wake
        if wake is not None:
            wake()

    # ---- either side ---------------------------------------------------------------------
    def cancel(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (the first cancel wins)."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
            left = [p for p in self._backlog if p is not None]
            self._backlog.clear()
            wake = self._wake
        for part in left:
            part.done()
        if wake is not None:
            wake()

    def take(self) -> list[SpooledPart]:
        """The parts put so far and not taken yet, without waiting (for a caller with no
        event loop: a local-only save, a test)."""
        with self._lock:
            out = [p for p in self._backlog if p is not None]
            self._backlog = deque(p for p in self._backlog if p is None)
        return out

    # ---- the consumer (the uploader's event loop) ----------------------------------------
    async def __aiter__(self) -> AsyncIterator[SpooledPart]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        with self._lock:
            self._wake = wake
        while True:
            with self._lock:
                batch = list(self._backlog)
                self._backlog.clear()
                if not batch and self._failure is None:
                    ready.clear()
            if self._failure is not None:
                for part in batch:
                    if part is not None:
                        part.done()
                return
            if not batch:
                await ready.wait()
                continue
            for item in batch:
                if item is None:
                    return
                yield item
