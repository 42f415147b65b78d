"""Run a function on N ranks (gloo on 127.0.0.1) for multi-rank tests and benchmarks."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_volumes._compat import GLOO_TEARDOWN_MAY_DEADLOCK

__all__ = ["free_port", "run_ranks", "run_ranks_with_victim"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        try:
            out = fn(rank, world_size, *args)
        finally:
            if not GLOO_TEARDOWN_MAY_DEADLOCK:
                dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException as exc:  # noqa: BLE001 — reported to the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if GLOO_TEARDOWN_MAY_DEADLOCK:
        # This torch can hang tearing a gloo group down (see _compat): hand over the result
        # and leave without running any destructor.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              env: dict[str, str] | None = None, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be importable (module level). Returns each rank's return value, in rank
    order; raises ``RuntimeError`` with every failing rank's traceback otherwise.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, dict(env or {}), results),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, out = results.get(timeout=timeout)
            if ok:
                outputs[rank] = out
            else:
                failures.append(f"rank {rank}: {out}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [outputs[r] for r in range(world_size)]


def run_ranks_with_victim(world_size: int, victim: int, fn: Callable[..., Any], *args: Any,
                          timeout: float = 240.0) -> dict[int, tuple[bool, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks, one of which (``victim``)
    SIGKILLs itself: every other rank must report (succeed or fail) within ``timeout``.

    Returns ``{rank: (ok, value or traceback)}`` of the ranks that reported. Raises
    ``RuntimeError`` naming the ranks that hung, or when the victim did not die by SIGKILL.
    """
    import queue
    import signal

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, {}, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reported: dict[int, tuple[bool, Any]] = {}
    try:
        while len(reported) < world_size - 1:
            rank, ok, out = results.get(timeout=timeout)
            reported[rank] = (ok, out)
    except queue.Empty:
        hung = sorted(set(range(world_size)) - set(reported) - {victim})
        raise RuntimeError(f"ranks {hung} hung after rank {victim} was killed") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    if procs[victim].exitcode != -signal.SIGKILL:
        raise RuntimeError(f"rank {victim} exited with {procs[victim].exitcode}, not SIGKILL")
    return reported
