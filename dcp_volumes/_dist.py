"""Small process-group helpers shared by cooperative loads and partner replicas: CPU byte
tensors over a buffer, the gloo group for them, bounded waits, and status agreement.

Every wait here is bounded by the caller's timeout (never only by the process group's own,
30 minutes by default): a rank that died or hangs makes the others raise a typed error.
What waits *after* one of these raises is not ours to bound (DCP's own collectives wait for
the process group's timeout, set by ``dist.init_process_group(timeout=...)``).
"""

from __future__ import annotations

import datetime
import json
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes import errors

__all__ = ["FAILED", "FALLBACK", "OK", "agree", "cpu_group", "uint8_tensor", "wait_all"]

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


def cpu_group(new_gloo: bool) -> Any:
    """The group to exchange CPU tensors on: the default one (None), or, when its backend
    cannot carry CPU tensors (NCCL alone), a gloo group over the same ranks, made once per
    process (``new_group`` is a collective: every rank must get here together)."""
    if not new_gloo:
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]


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


def agree(err: BaseException | None, *, group: Any, world: int, me: int, timeout_s: float,
          task: str, step: str, code: int = OK, note: str = "",
          error: type[errors.DCPVolumesError] = errors.DownloadError) -> int:
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

    Returns:
        The highest code any rank reported (every code below ``FAILED``).
    """
    codes = torch.zeros(world, dtype=torch.int64)
    codes[me] = FAILED if err is not None else code
    try:
        dist.all_reduce(codes, group=group, async_op=True).wait(
            timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if err is not None:
            raise err  # this rank's own failure says more than the lost peers
        raise error(
            f"rank {me}: the other ranks' status did not arrive while {task} ({step}; this "
            f"rank waited {timeout_s:.0f}s): a rank died or is stuck{note} ({exc})") from exc
    reported = codes.tolist()
    failed = [r for r, c in enumerate(reported) if c == FAILED]
    if not failed:
        return max(reported)
    src = failed[0]
    try:
        name, text = _broadcast_error(err if me == src else None, src, group, timeout_s)
    except RuntimeError as exc:  # the failing rank died after reporting: name it anyway
        if err is None:
            raise error(f"rank {src} failed while {task} ({step}) and its message did not "
                        f"arrive within {timeout_s:.0f}s{note} ({exc})") from exc
    if err is not None:
        raise err
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DCPVolumesError)):
        cls = error
    more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise cls(f"rank {src}{more} failed while {task} ({step}): {text}")


def _broadcast_error(err: BaseException | None, src: int, group: Any, timeout_s: float
                     ) -> tuple[str, str]:
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
    dist.broadcast(buf, src=src, group=group, async_op=True).wait(
        timeout=datetime.timedelta(seconds=timeout_s))
    raw = buf.numpy().tobytes().rstrip(b"\0")
    try:
        name, text = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, TypeError):
        return "", "?"
    return str(name), str(text)

