"""Restore from the local tier against restore from the store, and local-only saves (issue 11).

Saves one state (the harness's model-like layout, ``--size``) to a local SeaweedFS with
``LocalTierOptions`` (the tier on local disk), then, ``--reps`` times, interleaved in this one
process, for each network profile (``direct``: straight to the server; ``s3-like``: through
the benchmark's proxy process, 30 ms before every response and 10 MB/s per connection, as
``dcp-volumes bench`` uses):

- ``store``: ``VolumeReader`` without a tier (every shard byte from the store);
- ``tier``: ``VolumeReader(local_tier=...)``: ``.metadata`` and manifest from the store,
  shard bytes from local disk, every byte CRC32C-checked either way;

and, once per rep, two local references that do not depend on the profile:

- ``plain-read``: the same tier files read whole with ``readinto`` into one buffer allocated
  before the clock starts (no checksum, no placement into tensors): the local I/O floor;
- ``torch-fs``: the same state saved with torch's ``FileSystemWriter`` on the same disk and
  loaded with its ``FileSystemReader`` (no checksums).

Then the save side (``--save-reps``): a ``Checkpointer(async_save=True)`` alternating a
local-only save and a durable one (direct profile), each reported as its blocking time
(``save()`` returning) and its completion (``wait()``), beside the two floors: copying the
state into preallocated CPU buffers (memory copy) and writing the same bytes to a file on the
tier's disk with fsync. Prints one JSON line per measurement and markdown tables of medians
(min–max)::

    python benchmarks/local_tier_restore.py --size 1GiB --reps 5

What it models: a restart on the same node (a crashed process, a job requeued onto its
nodes), where the tier's files are usually still in the page cache; after a reboot they are
read from the disk itself, at the disk's speed. The store here is on loopback: against a
remote store the store column grows with the network, the tier column does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

MiB = 1 << 20
_PROFILE = {"first_byte_delay_s": 0.030, "per_connection_bytes_per_s": 10e6}


def _load(url: str, options: dict[str, Any], pool: str, specs: Any, tier: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeReader
    from dcp_volumes.bench.measure import Timer
    from dcp_volumes.bench.state import build_state, check_state

    target = build_state(pool, specs, layout="replicated", fill=False)
    reader = VolumeReader(url, storage_options=options, local_tier=tier)
    gc.collect()
    with Timer() as load:
        dcp.load(target, storage_reader=reader, no_dist=True)
    st = reader.last_stats
    assert st is not None
    return {"load_s": load.wall, "load_cpu_s": load.cpu, "bytes_needed": st.bytes_needed,
            "bytes_fetched": st.bytes_fetched, "bytes_from_local": st.bytes_from_local,
            "local_fallbacks": st.local_fallbacks, "verified": st.verified,
            "ok": check_state(pool, specs, target, layout="replicated")}


def _plain_read(directory: str) -> dict[str, Any]:
    """Every file under ``directory`` read whole into one reused buffer, allocated and
    touched before the clock starts: the local I/O floor (no checksum, no placement)."""
    from dcp_volumes.bench.measure import Timer

    paths = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
    buf = bytearray(max(os.path.getsize(p) for p in paths))
    view = memoryview(buf)
    total = 0
    gc.collect()
    with Timer() as t:
        for path in paths:
            size = os.path.getsize(path)
            with open(path, "rb", buffering=0) as f:
                done = 0
                while done < size:
                    n = f.readinto(view[done:size])
                    if not n:
                        break
                    done += n
            total += done
    view.release()
    return {"load_s": t.wall, "load_cpu_s": t.cpu, "bytes_from_local": total,
            "bytes_fetched": 0, "ok": True, "verified": False}


def _torch_fs(path: str, pool: str, specs: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes.bench.measure import Timer
    from dcp_volumes.bench.state import build_state, check_state

    target = build_state(pool, specs, layout="replicated", fill=False)
    gc.collect()
    with Timer() as t:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return {"load_s": t.wall, "load_cpu_s": t.cpu, "bytes_from_local": 0, "bytes_fetched": 0,
            "ok": check_state(pool, specs, target, layout="replicated"), "verified": False}


def _copy_floor(state: dict[str, Any], buffers: dict[str, Any]) -> float:
    import torch

    t0 = time.perf_counter()
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            buffers[k].copy_(v)
    return time.perf_counter() - t0


def _disk_floor(state: dict[str, Any], directory: str) -> float:
    import torch

    path = os.path.join(directory, f"floor-{uuid.uuid4().hex[:8]}.bin")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for v in state.values():
            if isinstance(v, torch.Tensor):
                f.write(memoryview(v.contiguous().view(torch.uint8).numpy()))
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    os.unlink(path)
    return took


def _fmt(values: list[float], digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}–{max(values):.{digits}f})")


def _emit(row: dict[str, Any], rows: list[dict[str, Any]], out: str | None) -> None:
    from dcp_volumes.bench.facts import machine, versions

    row.update({"command": " ".join(sys.argv), "versions": versions(), "machine": machine(),
                "time": time.time()})
    rows.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _restore_table(rows: list[dict[str, Any]], size: int) -> None:
    print("\n| profile | source | load s | × store | × plain-read | MiB/s | from the store "
          "| from local disk | CPU s | all equal, verified |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    plain = statistics.median(r["load_s"] for r in rows if r["source"] == "plain-read")
    for profile in ("direct", "s3-like", "local"):
        store = [r["load_s"] for r in rows if r["profile"] == profile and r["source"] == "store"]
        for source in ("store", "tier", "plain-read", "torch-fs"):
            rs = [r for r in rows if r["profile"] == profile and r["source"] == source]
            if not rs:
                continue
            t = [r["load_s"] for r in rs]
            med = statistics.median(t)
            vs_store = f"{med / statistics.median(store):.2f}" if store else "–"
            print(f"| {profile} | {source} | {_fmt(t)} | {vs_store} | {med / plain:.2f} | "
                  f"{size / MiB / med:.0f} | "
                  f"{statistics.median(r['bytes_fetched'] for r in rs) / MiB:.1f} MiB | "
                  f"{statistics.median(r['bytes_from_local'] for r in rs) / MiB:.1f} MiB | "
                  f"{_fmt([r['load_cpu_s'] for r in rs])} | "
                  f"{all(r['ok'] for r in rs)}, {all(r['verified'] for r in rs)} |")


def _save_table(rows: list[dict[str, Any]]) -> None:
    print("\n| save | blocking s | completion s |")
    print("|---|---|---|")
    for kind in ("local-only", "durable", "copy-floor", "disk-floor"):
        rs = [r for r in rows if r["save"] == kind]
        if not rs:
            continue
        blocking = _fmt([r["blocking_s"] for r in rs], 3) if "blocking_s" in rs[0] else "–"
        print(f"| {kind} | {blocking} | {_fmt([r['completion_s'] for r in rs], 3)} |")


def _restore(args: argparse.Namespace, server: Any, root: str, tmp: str, pool: str, specs: Any,
             state: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import LocalTierOptions, SpoolOptions, VolumeWriter
    from dcp_volumes.bench.target import ProfileProxy

    url = f"{root}/run/step-1"
    tier = LocalTierOptions(directory=os.path.join(tmp, "tier"))
    spool = SpoolOptions(directory=os.path.join(tmp, "spool"))
    os.makedirs(spool.directory or "", exist_ok=True)
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=server.storage_options(),
                                                spool=spool, local_tier=tier), no_dist=True)
    fs_path = os.path.join(tmp, "torch-fs")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(fs_path), no_dist=True)
    proxies: dict[str, Any] = {}
    try:
        options = {}
        for profile in args.profiles:
            if profile == "s3-like":
                proxies[profile] = ProfileProxy(server.endpoint_url, _PROFILE["first_byte_delay_s"],
                                                _PROFILE["per_connection_bytes_per_s"])
                options[profile] = server.storage_options(
                    endpoint_url=proxies[profile].endpoint_url)
            else:
                options[profile] = server.storage_options()
        jobs = [(p, s) for p in args.profiles for s in ("store", "tier")]
        jobs += [("local", "plain-read"), ("local", "torch-fs")]
        for rep in range(args.reps):
            for profile, source in (jobs if rep % 2 == 0 else jobs[::-1]):
                if source == "plain-read":
                    result = _plain_read(tier.resolved_directory())
                elif source == "torch-fs":
                    result = _torch_fs(fs_path, pool, specs)
                else:
                    result = _load(url, options[profile], pool, specs,
                                   tier if source == "tier" else None)
                _emit({"section": "restore", "profile": profile, "source": source, "rep": rep,
                       "size": args.size, **result}, rows, args.out)
    finally:
        for proxy in proxies.values():
            proxy.stop()


def _saves(args: argparse.Namespace, server: Any, root: str, tmp: str,
           state: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    import torch

    from dcp_volumes import Checkpointer, LocalTierOptions, SpoolOptions

    tier = LocalTierOptions(directory=os.path.join(tmp, "tier-saves"), keep_last=2)
    spool = SpoolOptions(directory=os.path.join(tmp, "spool-saves"))
    os.makedirs(spool.directory or "", exist_ok=True)
    buffers = {k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    with Checkpointer(f"{root}/saves", storage_options=server.storage_options(),
                      async_save=True, keep_last=2, spool=spool, local_tier=tier) as ckpt:
        ckpt.save(0, state, local_only=True)  # first save: allocates the staging buffers
        ckpt.wait()
        step = 0
        for rep in range(args.save_reps):
            kinds = ["local-only", "durable", "copy-floor", "disk-floor"]
            for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
                gc.collect()
                if kind == "copy-floor":
                    row = {"completion_s": _copy_floor(state, buffers)}
                elif kind == "disk-floor":
                    row = {"completion_s": _disk_floor(state, tier.resolved_directory())}
                else:
                    step += 1
                    t0 = time.perf_counter()
                    ckpt.save(step, state, force=True, local_only=kind == "local-only")
                    blocking = time.perf_counter() - t0
                    ckpt.wait()
                    row = {"blocking_s": blocking, "completion_s": time.perf_counter() - t0}
                _emit({"section": "save", "save": kind, "rep": rep, "size": args.size, **row},
                      rows, args.out)


def main(argv: list[str] | None = None) -> int:
    from dcp_volumes.bench.harness import parse_size
    from dcp_volumes.bench.state import build_state, layout_for, write_pool
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=512 * MiB)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--save-reps", type=int, default=3)
    p.add_argument("--profiles", nargs="+", default=["direct", "s3-like"],
                   choices=["direct", "s3-like"])
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    args = p.parse_args(argv)
    server = start_server("seaweedfs")
    rows: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="dcpv-tier-bench-")
    try:
        root = server.create_bucket(f"tier-{uuid.uuid4().hex[:8]}")
        pool = os.path.join(tmp, "pool")
        write_pool(pool, args.size + MiB)
        specs = layout_for(args.size)
        state = build_state(pool, specs, layout="replicated")
        if args.reps:
            _restore(args, server, root, tmp, pool, specs, state, rows)
        if args.save_reps:
            _saves(args, server, root, tmp, state, rows)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.reps:
        _restore_table([r for r in rows if r["section"] == "restore"], args.size)
    if args.save_reps:
        _save_table([r for r in rows if r["section"] == "save"])
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
