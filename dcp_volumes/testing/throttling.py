"""A multi-rank save against a throttling store (rank functions importable by spawned ranks).

Used by ``tests/integration/test_throttling.py`` and ``benchmarks/throttled_save.py``: every
rank saves its own small tensors (distinct keys, so each rank uploads its share) into
``files`` shard files, through a :class:`~dcp_volumes.testing.faultproxy.FaultProxy` whose
:class:`~dcp_volumes.testing.faultproxy.PrefixRateLimit` answers 503 SlowDown above the rate.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["load_own_keys", "rank_state", "save_own_keys"]


def rank_state(rank: int, files: int, kib: int) -> dict[str, torch.Tensor]:
    """``files`` tensors of ``kib`` KiB each, keyed by rank (deterministic values)."""
    g = torch.Generator().manual_seed(7919 * (rank + 1))
    n = max(1, kib * 1024 // 4)
    return {f"rank{rank}.t{i}": torch.randn(n, generator=g) for i in range(files)}


def save_own_keys(rank: int, world_size: int, url: str, storage_options: dict[str, Any],
                  transfer: dict[str, Any], files: int, kib: int) -> dict[str, Any]:
    """Save :func:`rank_state` with ``SpoolOptions(files_per_rank=files)`` and
    ``TransferOptions(**transfer)``; returns this rank's SaveStats, wall time, and what its
    process's throttle did (None if the reaction is off)."""
    from dcp_volumes import RetryOptions, SpoolOptions, TransferOptions, VolumeWriter

    state = rank_state(rank, files, kib)
    writer = VolumeWriter(url, storage_options=storage_options,
                          spool=SpoolOptions(files_per_rank=files, mode="memory"),
                          transfer=TransferOptions(**transfer),
                          retry=RetryOptions(deadline_s=300.0))
    # Warm the client (imports, session, connection pool) before the clock starts, as the
    # coordinator's is by its plan step: otherwise ranks start uploading seconds apart on a
    # small machine, and the skew reads as lost throughput.
    backend = writer.backend()
    client = getattr(backend, "client", None)
    if client is not None:
        backend.run(client)
    dist.barrier()
    start = time.monotonic()
    error = None
    try:
        dcp.save(state, storage_writer=writer)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 — torch's CheckpointException is a
        # BaseException; reported, as the comparison counts failed saves
        error = f"{type(exc).__name__}: {exc}"[:300]
    wall = time.monotonic() - start
    throttle = writer.backend().throttle
    stats = writer.last_stats.as_dict() if writer.last_stats else {}
    return {
        **stats,
        "wall_s": wall,
        "error": error,
        "throttle_cuts": throttle.cuts if throttle is not None else None,
        "throttle_rate": throttle.rate if throttle is not None else None,
    }


def load_own_keys(rank: int, world_size: int, url: str, storage_options: dict[str, Any],
                  files: int, kib: int, torch_reader: bool = False) -> bool:
    """Load this rank's keys back (VolumeReader, or torch's FsspecReader) and compare."""
    from dcp_volumes import VolumeReader

    expected = rank_state(rank, files, kib)
    state = {k: torch.zeros_like(v) for k, v in expected.items()}
    reader: Any
    if torch_reader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(url, **storage_options)
    else:
        reader = VolumeReader(url, storage_options=storage_options)
    dcp.load(state, storage_reader=reader)
    return all(torch.equal(state[k], v) for k, v in expected.items())
