"""Small process-group helpers shared by cooperative loads and partner replicas: CPU byte
tensors over a buffer, the gloo group for them, bounded waits, and status agreement.

Every wait of :func:`agree`, :func:`broadcast` and :func:`wait_all` is bounded by the
caller's timeout (never only by the process group's own, 30 minutes by default): a rank that
died or hangs makes the others raise a typed error that says which it was, with the time
really waited. (:func:`from_rank0` is one ``broadcast_object_list``: it waits as long as the
process group does.) What waits *after* one of these raises is the caller's to bound:
:func:`agree`'s ``on_lost`` tells it when a peer was lost (the shared read of a commit then
leaves DCP's own collectives, :mod:`dcp_volumes._shared_commit`).
"""

from __future__ import annotations

import datetime
import json
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from dcp_volumes import errors

__all__ = ["FAILED", "FALLBACK", "OK", "agree", "broadcast", "collective", "cpu_group",
           "from_rank0", "gloo_group", "uint8_tensor", "wait_all"]

#: status codes a rank reports at a step (:func:`agree`); a caller may use any code below
#: ``FAILED`` for its own outcomes
OK, FALLBACK, FAILED = 0, 1, 2
#: bytes of a failing rank's error (class name and message) sent to the others
MESSAGE_BYTES = 8192

_GLOO_GROUPS: dict[int, Any] = {}


def uint8_tensor(buf: Any) -> torch.Tensor:
    """A ``uint8`` tensor over ``buf`` (any buffer: bytes, bytearray, memoryview), no copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: gloo only reads what it sends
        return torch.frombuffer(buf, dtype=torch.uint8)


def gloo_group(*, own: bool = False) -> Any:
    """A gloo group over every rank of the default group: object and CPU-tensor collectives
    whatever the default backend is (NCCL alone carries no CPU tensors). ``None`` when
    torch.distributed is not initialized. The one place such a group is made.

    ``own=False``: the process's shared one (made once per default group), for collectives
    made on the training loop's thread (cooperative loads, listings, resumes). ``own=True``:
    a new group, for a caller whose collectives must never interleave with another
    thread's (a Checkpointer's control and background-save groups). Making one is a
    collective: every rank must get here together.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if own:
        return dist.new_group(backend="gloo")
    key = id(dist.group.WORLD)
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]


def cpu_group(new_gloo: bool) -> Any:
    """The group to exchange CPU tensors on: the default one (None), or, when its backend
    cannot carry CPU tensors (NCCL alone), the shared gloo group (:func:`gloo_group`)."""
    return gloo_group() if new_gloo else None


def from_rank0(fn: Callable[[], Any], group: Any, distributed: bool = True) -> Any:
    """``fn()`` on rank 0 of ``group``, its answer -- or its error -- on every rank (one
    ``broadcast_object_list``; every rank of ``group`` must call it). Not ``distributed``:
    just ``fn()``.

    Raises:
        What ``fn`` raised on rank 0 (an error that does not pickle arrives as a
        :class:`~dcp_volumes.errors.DCPVolumesError` naming its class).
    """
    if not distributed:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:  # noqa: BLE001 -- every rank must raise it, not hang
            box[0] = (False, exc)
    try:
        dist.broadcast_object_list(box, group_src=0, group=group)
    except Exception as exc:  # rank 0's error did not pickle
        raise errors.DCPVolumesError(f"rank 0's answer could not be sent ({type(exc).__name__})"
                                     ) from exc
    ok, value = box[0] if isinstance(box[0], tuple) and len(box[0]) == 2 else (False, None)
    if ok:
        return value
    if isinstance(value, BaseException):
        raise value
    raise errors.DCPVolumesError("rank 0 sent no answer")


def wait_all(works: Sequence[Any], timeout_s: float,
             fail: Callable[[int, RuntimeError], BaseException] | None = None) -> None:
    """Wait for every work (``isend``/``irecv``/async collectives) ``timeout_s`` in all.

    Raises:
        ``fail(index, error)`` for the first work that failed or did not finish in time
        (without ``fail``: that ``RuntimeError``).
    """
    deadline = time.monotonic() + timeout_s
    for i, work in enumerate(works):
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            if fail is None:
                raise
            raise fail(i, exc) from exc


def collective(start: Callable[[], Any], *, timeout_s: float, what: str,
               fail: Callable[[str, RuntimeError], BaseException]) -> None:
    """Start one asynchronous collective (``start()`` returns its work) and wait for it at
    most ``timeout_s``: the one bounded wait every collective here goes through.

    Raises:
        ``fail(said, error)``, from the collective's ``RuntimeError``, when it failed or did
        not finish in time; ``said`` tells which, with the time really waited (a killed
        peer closes its connection at once: saying "did not arrive within" the whole limit
        would be false), ``what`` being what did not arrive.
    """
    started = time.monotonic()
    try:
        start().wait(timeout=datetime.timedelta(seconds=max(0.001, timeout_s)))
    except RuntimeError as exc:
        raise fail(_lost(time.monotonic() - started, timeout_s, what), exc) from exc


def broadcast(t: torch.Tensor, *, src: int, group: Any, timeout_s: float, what: str,
              fail: Callable[[str, RuntimeError], BaseException]) -> None:
    """``t`` from global rank ``src`` to every rank of ``group`` (in place), waiting at most
    ``timeout_s`` (:func:`collective`, which says how ``fail`` is called)."""
    collective(lambda: dist.broadcast(t, src=src, group=group, async_op=True),
               timeout_s=timeout_s, what=what, fail=fail)


def agree(err: BaseException | None, *, group: Any, world: int, me: int, timeout_s: float,
          task: str, step: str, code: int = OK, note: str = "",
          error: type[errors.DCPVolumesError] = errors.DownloadError,
          on_lost: Callable[[], None] | None = None) -> int:
    """Every rank reports a status at ``step``; if any failed, every rank raises.

    ``err``: this rank's failure (None: it reports ``code``). One all-reduce of one integer
    per rank; when some rank failed, its error (class name and message) is broadcast, and
    every rank raises that class (a :mod:`dcp_volumes.errors` class, else ``error``) with
    that message, naming the rank; the failing rank raises its own ``err``. Each collective
    waits at most ``timeout_s``.

    Args:
        task: what the ranks do, for messages ("loading s3://b/c cooperatively").
        step: where they are ("planning", "round 2/5").
        note: added to the message when a peer did not answer in time (what may still wait).
        error: the class raised when a peer did not answer, or sent an unknown class.
        on_lost: called before raising when a peer did not answer (died, or not within
            ``timeout_s``): the ranks no longer agree on where they are, so the caller
            stops waiting for them in collectives of its own.

    Returns:
        The highest code any rank reported (every code below ``FAILED``).
    """
    what = f"while {task} ({step})"
    lost = on_lost or (lambda: None)
    reported = _all_codes(err, code, group=group, world=world, me=me, timeout_s=timeout_s,
                          what=what, note=note, error=error, on_lost=lost)
    failed = [r for r, c in enumerate(reported) if c == FAILED]
    if not failed:
        return max(reported)
    _raise_failed(err, failed, group=group, me=me, timeout_s=timeout_s, what=what, note=note,
                  error=error, on_lost=lost)


def _all_codes(err: BaseException | None, code: int, *, group: Any, world: int, me: int,
               timeout_s: float, what: str, note: str,
               error: type[errors.DCPVolumesError], on_lost: Callable[[], None]) -> list[int]:
    """Every rank's status code (one all-reduce, bounded by ``timeout_s``)."""
    codes = torch.zeros(world, dtype=torch.int64)
    codes[me] = FAILED if err is not None else code
    try:
        collective(lambda: dist.all_reduce(codes, group=group, async_op=True),
                   timeout_s=timeout_s, what="the other ranks' status",
                   fail=lambda said, exc: error(f"rank {me}: {said} {what}{note} ({exc})"))
    except error:
        on_lost()
        if err is not None:
            raise err  # this rank's own failure says more than the lost peers
        raise
    reported: list[int] = codes.tolist()
    return reported


def _raise_failed(err: BaseException | None, failed: list[int], *, group: Any, me: int,
                  timeout_s: float, what: str, note: str,
                  error: type[errors.DCPVolumesError], on_lost: Callable[[], None]) -> NoReturn:
    """Raise on every rank: the first failed rank's own error there, its class and message
    (broadcast) elsewhere."""
    src = failed[0]
    try:  # the failing rank may die after reporting: name it anyway
        name, text = _broadcast_error(
            err if me == src else None, src, group, timeout_s,
            fail=lambda said, exc: error(f"rank {src} failed {what} and its message did not "
                                         f"arrive: {said}{note} ({exc})"))
    except error:
        on_lost()
        if err is None:
            raise
    if err is not None:
        raise err
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DCPVolumesError)):
        cls = error
    more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise cls(f"rank {src}{more} failed {what}: {text}")


def _lost(waited: float, timeout_s: float, what: str) -> str:
    """What happened when a collective failed after ``waited`` seconds, said truthfully: the
    limit ran out (a rank is stuck or died silently), or a rank's connection closed first
    (its process ended: killed, crashed, exited after an error of its own, or its host went
    away). ``what``: what did not arrive."""
    if waited >= 0.9 * timeout_s:
        return (f"{what} did not arrive within {timeout_s:.0f}s: a rank is stuck, or died "
                "without closing its connection")
    return (f"a rank's connection closed after {waited:.1f}s (of up to {timeout_s:.0f}s this "
            f"rank would wait for {what}): that rank died or exited (killed, crashed, gave "
            "up after an error of its own, or its host went away)")


def _broadcast_error(err: BaseException | None, src: int, group: Any, timeout_s: float, *,
                     fail: Callable[[str, RuntimeError], BaseException]) -> tuple[str, str]:
    """``src``'s error as (class name, message), sent in one bounded broadcast of
    :data:`MESSAGE_BYTES` (a longer message is cut)."""
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if err is not None:
        text = str(err)
        raw = json.dumps([type(err).__name__, text]).encode()
        while len(raw) > MESSAGE_BYTES:
            text = text[:len(text) * 3 // 4]
            raw = json.dumps([type(err).__name__, text + "..."]).encode()
        buf[:len(raw)] = uint8_tensor(bytearray(raw))
    # src is a global rank: the groups used here span all ranks
    broadcast(buf, src=src, group=group, timeout_s=timeout_s, what=f"rank {src}'s error",
              fail=fail)
    raw = buf.numpy().tobytes().rstrip(b"\0")
    try:
        name, text = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, TypeError):
        return "", "?"
    return str(name), str(text)
