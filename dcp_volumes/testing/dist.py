"""Run a function on N ranks (gloo on 127.0.0.1) for multi-rank tests and benchmarks.

Ranks fork from a clean server process that has imported torch (multiprocessing's
``forkserver``), with the parent's current environment. Every run has one deadline: a rank
that does not report by then fails the run with a message naming the rank, its pid and the
phase it was in (joining the group, running ``fn``, tearing the group down), and every
rank still alive is killed by its pid; a rank that exits without reporting is named too.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_volumes._compat import GLOO_TEARDOWN_MAY_DEADLOCK

__all__ = ["RanksHungError", "free_port", "run_ranks", "run_ranks_with_victim"]

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: how long a rank that has exited may take to have its report arrive through the queue
_REPORT_GRACE_S = 5.0
#: how long ranks that have all reported may take to exit before they are killed
_EXIT_GRACE_S = 30.0


class RanksHungError(RuntimeError):
    """Spawned ranks did not report within the run's deadline (they have been killed)."""


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           env: dict[str, str], results: Any) -> None:
    # the parent's environment as it is now (the fork server's is as it was at its start)
    os.environ.clear()
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        # the parent names the phase a rank that never reports was last in
        results.put(("phase", rank, "init_process_group"))
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        try:
            results.put(("phase", rank, f"running {_name(fn)}"))
            out = fn(rank, world_size, *args)
        finally:
            if not GLOO_TEARDOWN_MAY_DEADLOCK:
                results.put(("phase", rank, "destroy_process_group"))
                dist.destroy_process_group()
        results.put(("done", rank, True, out))
    except BaseException as exc:  # noqa: BLE001 — reported to the parent
        results.put(("done", rank, False,
                     f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if GLOO_TEARDOWN_MAY_DEADLOCK:
        # This torch can hang tearing a gloo group down (see _compat): hand over the result
        # and leave without running any destructor.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _context() -> Any:
    """Ranks fork from a server process that has imported torch once, instead of each
    importing it afresh (most of a rank's start-up, and the most of it on a busy machine);
    the server is started clean (no threads, no process group), as spawn would be."""
    ctx = mp.get_context("forkserver")
    # (what the server imported stays as it imported it: environment variables read at
    # torch's import time come from the parent's environment when the server started)
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint"])
    return ctx


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class _Ranks:
    """``world_size`` spawned ranks running ``fn``, their reports, and one deadline."""

    def __init__(self, world_size: int, fn: Callable[..., Any], args: tuple[Any, ...],
                 env: dict[str, str], timeout: float, label: str | None) -> None:
        ctx = _context()
        self.label = label or f"{_name(fn)} on {world_size} ranks"
        self.timeout = timeout
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_entry, daemon=False,
                                  args=(r, world_size, port, fn, args, env, self.results))
                      for r in range(world_size)]
        self.phase = {r: "starting" for r in range(world_size)}
        self.reported: dict[int, tuple[bool, Any]] = {}
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.running_at: dict[int, float] = {}  # when each rank began running fn
        for p in self.procs:
            p.start()

    def collect(self, expected: set[int]) -> list[str]:
        """Wait (until the deadline) for every rank in ``expected`` to report; returns a
        line per rank that exited without reporting. Raises :class:`RanksHungError`, after
        killing every rank still alive, when one of them does not report in time."""
        gone_since: dict[int, float] = {}
        died: list[str] = []
        waiting = set(expected)
        while waiting:
            now = time.monotonic()
            if now >= self.deadline:
                self.kill_all()
                raise RanksHungError(self._hung_message(sorted(waiting)))
            try:
                msg = self.results.get(timeout=min(0.5, self.deadline - now))
            except queue.Empty:
                msg = None
            if msg is not None and msg[0] == "phase":
                self.phase[msg[1]] = msg[2]
                if msg[2].startswith("running"):
                    self.running_at[msg[1]] = time.monotonic()
            elif msg is not None:
                _, rank, ok, out = msg
                self.reported[rank] = (ok, out)
                waiting.discard(rank)
            for rank in sorted(waiting):
                code = self.procs[rank].exitcode
                if code is None:
                    continue
                first = gone_since.setdefault(rank, time.monotonic())
                if time.monotonic() - first >= _REPORT_GRACE_S:
                    died.append(f"rank {rank} (pid {self.procs[rank].pid}) exited with code "
                                f"{code} in phase {self.phase[rank]!r} without reporting")
                    waiting.discard(rank)
        return died

    def _hung_message(self, hung: list[int]) -> str:
        done = sorted(self.reported)
        lines = [f"{self.label}: no report within {self.timeout:.0f} s from "
                 + ", ".join(f"rank {r} (pid {self.procs[r].pid}, last in phase "
                             f"{self.phase[r]!r})" for r in hung)
                 + f"; ranks {done} reported; every rank still alive was killed"]
        lines += [f"rank {r} failed: {out}" for r, (ok, out) in sorted(self.reported.items())
                  if not ok]
        return "\n".join(lines)

    def finish(self, grace: float = _EXIT_GRACE_S) -> None:
        """Let the ranks exit (one grace period for all of them), then kill the rest."""
        end = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        self.kill_all()
        if self.running_at:
            logger.info("%s: %.1fs (%.1fs to spawn and join the group)", self.label,
                        time.monotonic() - self.started,
                        max(self.running_at.values()) - self.started)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()  # SIGKILL to that rank's pid
                p.join(timeout=10)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              env: dict[str, str] | None = None, timeout: float = 240.0,
              label: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be importable (module level). Returns each rank's return value, in rank
    order; raises ``RuntimeError`` with every failing rank's traceback otherwise, and
    :class:`RanksHungError` naming each rank that did not report within ``timeout`` seconds
    (all ranks together, from the spawn) and the phase it was in; those ranks are killed.
    ``label`` names the run in errors (default: ``fn``'s name and the rank count).
    """
    ranks = _Ranks(world_size, fn, args, {**os.environ, **(env or {})}, timeout, label)
    try:
        died = ranks.collect(set(range(world_size)))
    finally:
        ranks.finish()
    failures = [f"rank {r}: {out}" for r, (ok, out) in sorted(ranks.reported.items()) if not ok]
    if failures or died:
        raise RuntimeError(f"{ranks.label}:\n" + "\n".join(failures + died))
    return [ranks.reported[r][1] for r in range(world_size)]


def run_ranks_with_victim(world_size: int, victim: int, fn: Callable[..., Any], *args: Any,
                          timeout: float = 240.0, label: str | None = None
                          ) -> dict[int, tuple[bool, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks, one of which (``victim``)
    SIGKILLs itself: every other rank must report (succeed or fail) within ``timeout``.

    Returns ``{rank: (ok, value or traceback)}`` of the ranks that reported. Raises
    :class:`RanksHungError` naming the ranks that hung (and their phase), or
    ``RuntimeError`` when the victim did not die by SIGKILL or another rank died.
    """
    ranks = _Ranks(world_size, fn, args, dict(os.environ), timeout,
                   label or f"{_name(fn)} on {world_size} ranks, rank {victim} killed")
    try:
        died = ranks.collect(set(range(world_size)) - {victim})
    finally:
        ranks.finish(grace=60.0)
    if died:
        raise RuntimeError(f"{ranks.label}:\n" + "\n".join(died))
    if ranks.procs[victim].exitcode != -signal.SIGKILL:
        raise RuntimeError(f"rank {victim} exited with {ranks.procs[victim].exitcode}, "
                           "not SIGKILL")
    return ranks.reported
