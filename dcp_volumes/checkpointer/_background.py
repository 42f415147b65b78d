"""A Checkpointer's save in flight (``async_save=True``): one at a time, its failure raised
on the caller's thread, typed, at the next point every rank reaches together."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes._api import typed_failure
from dcp_volumes.backends import redact_url

__all__ = ["Pending", "watch"]


@dataclass
class Pending:
    """The background save of ``step`` to ``url``; ``done`` settles after its commit."""

    step: int
    url: str
    done: concurrent.futures.Future[None]

    def result(self) -> None:
        """Wait for it; raise its typed error (the one behind DCP's ``CheckpointException``,
        which it chains) with a note naming the save."""
        try:
            self.done.result()
        except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
            note = (f"dcp_volumes: the background save of step {self.step} to "
                    f"{redact_url(self.url)} failed")
            typed = typed_failure(exc)
            failure = typed if typed is not None else exc
            if hasattr(failure, "add_note"):  # Python 3.11+
                failure.add_note(note)
            if typed is not None and typed is not exc:
                raise typed  # its cause stays the backend error; exc becomes its context
            raise


def watch(step: int, url: str, upload: concurrent.futures.Future[Any],
          settle: Callable[[], None]) -> Pending:
    """A :class:`Pending` that settles when ``upload`` did and ``settle`` (what follows a
    commit) ran after it; a failure of either is its result."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def _settle(fut: concurrent.futures.Future[Any]) -> None:
        exc = fut.exception()
        if exc is None:
            try:
                settle()
            except BaseException as late:  # noqa: BLE001 -- `done` must settle, or wait() hangs
                exc = late
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(None)

    upload.add_done_callback(_settle)
    return Pending(step, url, done)
