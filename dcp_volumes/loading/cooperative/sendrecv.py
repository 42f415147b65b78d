"""One round's bytes moved between the ranks of a cooperative load: point-to-point sends and
receives over the gloo group, bounded by the load's timeout (CPU tensors, one tag per bundle).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch.distributed as dist

from dcp_volumes import _dist, errors
from dcp_volumes.loading.cooperative.peer import RoundBytes
from dcp_volumes.loading.cooperative.storage_data import Bundle

__all__ = ["AFTER_TIMEOUT", "exchange_round"]

#: what the surviving ranks' error says about the wait that is not ours to bound
AFTER_TIMEOUT = (
    "; dcp.load's own collective after read_data then waits for the lost rank too, up to "
    "the process group's timeout (30 minutes by default, 10 with NCCL; lower it with "
    "dist.init_process_group(timeout=...)), before it raises this error"
)


def exchange_round(receives: list[Bundle], sends: list[Bundle], st: RoundBytes, *,
                   group: Any, me: int, url: str, timeout_s: float) -> tuple[int, int]:
    """Receive ``receives`` from their owners into ``st.recv_into``; send ``sends`` (their
    bytes in ``st.data``) to their consumers; wait for all of it up to ``timeout_s``.
    Returns the bytes received and sent.

    Raises:
        DownloadError: a send or receive failed or did not finish in time (a rank died or
            is stuck), naming which one.
    """
    works: list[Any] = []
    whats: list[str] = []
    got = sent = 0
    start = time.monotonic()
    fail = functools.partial(_failure, whats, me=me, url=url, timeout_s=timeout_s)
    try:
        for b in receives:
            if b.size == 0:
                continue
            whats.append(f"bytes {b.start}..{b.end} of shard {b.relative} from rank "
                         f"{b.owner}")
            works.append(dist.irecv(st.recv_into[b.bid], src=b.owner, group=group,
                                    tag=b.bid))
            got += b.size
        for b in sends:
            if not b.consumers or b.size == 0:
                continue
            t = _dist.uint8_tensor(st.data[b.bid])
            for c in b.consumers:
                whats.append(f"bytes {b.start}..{b.end} of shard {b.relative} to rank {c}")
                works.append(dist.isend(t, dst=c, group=group, tag=b.bid))
                sent += b.size
    except RuntimeError as exc:  # the one named last could not even start
        raise fail(len(whats) - 1, exc) from exc
    _dist.wait_all(works, start + timeout_s - time.monotonic(), fail)
    return got, sent


def _failure(whats: list[str], i: int, exc: RuntimeError, *, me: int, url: str,
             timeout_s: float) -> errors.DownloadError:
    what = whats[i] if i < len(whats) else "?"
    return errors.DownloadError(
        f"rank {me}: exchanging {what} of {url} failed or took longer than "
        f"{timeout_s:.0f}s: a rank died or is stuck{AFTER_TIMEOUT} ({exc})")
