"""What local servers and fault proxies share: ``with`` support and a stop at interpreter exit."""

from __future__ import annotations

import atexit
import contextlib
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["LiveSet", "StartStop"]


class _Stoppable(Protocol):
    def stop(self) -> None: ...


class StartStop:
    """``with obj:`` calls ``obj.start()`` on entry and ``obj.stop()`` on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

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


class LiveSet:
    """The running objects of one kind; ``atexit`` stops the ones still running.

    Each instance registers its own ``atexit`` hook when created (at its module's import), so
    kinds imported later are stopped first.
    """

    def __init__(self) -> None:
        self._live: set[_Stoppable] = set()
        self._lock = threading.Lock()
        atexit.register(self.stop_all)

    def add(self, obj: _Stoppable) -> None:
        with self._lock:
            self._live.add(obj)

    def discard(self, obj: _Stoppable) -> None:
        with self._lock:
            self._live.discard(obj)

    def stop_all(self) -> None:
        """Stop every object still registered; one failing does not keep the others running."""
        with self._lock:
            live = list(self._live)
        for obj in live:
            with contextlib.suppress(Exception):
                obj.stop()
