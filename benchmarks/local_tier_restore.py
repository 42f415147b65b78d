"""Restore from the local tier against restore from the store (issue 11's lever).

Saves one state (the harness's model-like layout, ``--size``) to a local SeaweedFS with
``LocalTierOptions`` (the tier on local disk), then loads it ``--reps`` times from the store
(``VolumeReader`` without a tier) and from the tier (``VolumeReader(local_tier=...)``: the
``.metadata`` and manifest still come from the store, the shard bytes from local disk, every
byte CRC32C-checked either way), interleaved, in this one process. Prints one JSON line per
load and a markdown table of medians (min–max)::

    python benchmarks/local_tier_restore.py --size 512MiB --reps 5

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
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

MiB = 1 << 20


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


def _fmt(values: list[float], digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}–{max(values):.{digits}f})")


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import LocalTierOptions, SpoolOptions, VolumeWriter
    from dcp_volumes.bench.facts import machine, versions
    from dcp_volumes.bench.harness import parse_size
    from dcp_volumes.bench.state import build_state, layout_for, write_pool
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=512 * MiB)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    args = p.parse_args(argv)
    server = start_server("seaweedfs")
    rows: list[dict[str, Any]] = []
    try:
        root = server.create_bucket(f"tier-{uuid.uuid4().hex[:8]}")
        options = server.storage_options()
        with tempfile.TemporaryDirectory() as tmp:
            pool = os.path.join(tmp, "pool")
            write_pool(pool, args.size + MiB)
            specs = layout_for(args.size)
            url = f"{root}/run/step-1"
            tier = LocalTierOptions(directory=os.path.join(tmp, "tier"))
            spool = SpoolOptions(directory=os.path.join(tmp, "spool"))
            os.makedirs(spool.directory or "", exist_ok=True)
            dcp.save(build_state(pool, specs, layout="replicated"),
                     storage_writer=VolumeWriter(url, storage_options=options, spool=spool,
                                                 local_tier=tier), no_dist=True)
            for rep in range(args.reps):
                order = ("store", "tier") if rep % 2 == 0 else ("tier", "store")
                for source in order:
                    row = {"source": source, "rep": rep, "size": args.size,
                           **_load(url, options, pool, specs, tier if source == "tier" else None),
                           "command": " ".join(sys.argv), "versions": versions(),
                           "machine": machine(), "time": time.time()}
                    rows.append(row)
                    line = json.dumps(row)
                    print(line, flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(line + "\n")
    finally:
        server.stop()
    by = {s: [r for r in rows if r["source"] == s] for s in ("store", "tier")}
    base = statistics.median(r["load_s"] for r in by["store"])
    print("| source | load s | × store | MiB/s | bytes from the store | bytes from local disk "
          "| CPU s | all loads equal and verified |")
    print("|---|---|---|---|---|---|---|---|")
    for source, rs in by.items():
        t = [r["load_s"] for r in rs]
        print(f"| {source} | {_fmt(t)} | {statistics.median(t) / base:.2f} | "
              f"{args.size / MiB / statistics.median(t):.0f} | "
              f"{statistics.median(r['bytes_fetched'] for r in rs) / MiB:.1f} MiB | "
              f"{statistics.median(r['bytes_from_local'] for r in rs) / MiB:.1f} MiB | "
              f"{_fmt([r['load_cpu_s'] for r in rs])} | "
              f"{all(r['ok'] and r['verified'] for r in rs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
