"""Replicated loads on 1, 4 and 8 ranks, cooperative on and off (issue 12's first target).

Saves one replicated state (the harness's model-like layout: 16 layers of a 32 MiB weight, a
bias and a norm, at 512 MiB) to a local SeaweedFS once, then loads it with every rank holding
all of it (DDP-style), for each world size with ``VolumeReader(cooperative=False)`` (every
rank fetches everything) and ``cooperative=True``, interleaved, ``--reps`` times. Prints one
JSON line per load and a markdown table of medians (min–max)::

    python benchmarks/cooperative_load.py --size 512MiB --ranks 1,4,8 --reps 3

The load time is rank 0's ``dcp.load`` plus a barrier (every rank done); process start-up
and each process's first contact with the store (imports, client set-up: a warm-up
``read_metadata``) are excluded, on every world size alike. "fetched ÷ unique" is the bytes all ranks fetched from the store over the bytes of
the stored items the load needs.
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


def _rank_load(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeReader
    from dcp_volumes.bench.measure import RssSampler, Timer, rss
    from dcp_volumes.bench.state import build_state, check_state, layout_for

    specs = layout_for(spec["size"])
    target = build_state(spec["pool"], specs, layout="replicated", fill=False)
    # warm-up: the imports and the store connection every process pays once (about 1 s of
    # CPU here; 8 ranks on 2 cores would pay it one after the other inside the timing)
    VolumeReader(spec["url"], storage_options=spec["options"]).read_metadata()
    reader = VolumeReader(spec["url"], storage_options=spec["options"],
                          cooperative=spec["cooperative"])
    gc.collect()
    base = rss()
    dist.barrier()
    with RssSampler() as sampler, Timer() as load:
        dcp.load(target, storage_reader=reader)
        dist.barrier()
    stats = reader.last_stats.as_dict() if reader.last_stats else {}
    ok = check_state(spec["pool"], specs, target, layout="replicated")
    return {"rank": rank, "load_s": load.wall, "load_cpu_s": load.cpu,
            "rss_peak_mib": (sampler.peak - base) / MiB, "ok": ok, "stats": stats}


def _measure(world: int, cooperative: bool, spec: dict[str, Any]) -> dict[str, Any]:
    from dcp_volumes.testing.dist import run_ranks

    ranks = run_ranks(world, _rank_load, {**spec, "cooperative": cooperative},
                      timeout=spec["timeout"])
    st = [r["stats"] for r in ranks]
    return {
        "world": world, "cooperative": cooperative, "load_s": ranks[0]["load_s"],
        "load_cpu_s": sum(r["load_cpu_s"] for r in ranks),
        "bytes_needed": st[0]["bytes_needed"],
        "bytes_fetched": sum(s["bytes_fetched"] for s in st),
        "bytes_from_peers": sum(s.get("bytes_from_peers", 0) for s in st),
        "peer_wait_s": max(s.get("peer_wait_s", 0.0) for s in st),
        "rounds": st[0].get("rounds", 0), "coop_used": all(s.get("cooperative") for s in st),
        "rss_peak_mib": max(r["rss_peak_mib"] for r in ranks),
        "ok": all(r["ok"] for r in ranks),
    }


def _fmt(values: list[float], digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}–{max(values):.{digits}f})")


def _table(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["world"], r["cooperative"]), []).append(r)
    base = statistics.median(r["load_s"] for r in groups.get((1, False), [{"load_s": 0}]))
    out = [("| ranks | cooperative | load s | × 1-rank load | fetched ÷ unique | from peers MiB "
            "(all ranks) | peer wait s (max rank) | rounds | client CPU s (all ranks) | "
            "peak RSS +MiB (max rank) |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (world, coop), rs in sorted(groups.items()):
        load = [r["load_s"] for r in rs]
        ratio = statistics.median(load) / base if base else float("nan")
        out.append(
            f"| {world} | {'on' if coop else 'off'} | {_fmt(load)} | {ratio:.2f} | "
            f"{statistics.median(r['bytes_fetched'] / r['bytes_needed'] for r in rs):.3f} | "
            f"{statistics.median(r['bytes_from_peers'] for r in rs) / MiB:.0f} | "
            f"{_fmt([r['peer_wait_s'] for r in rs])} | {rs[0]['rounds']} | "
            f"{_fmt([r['load_cpu_s'] for r in rs], 1)} | "
            f"{statistics.median(r['rss_peak_mib'] for r in rs):.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dcp_volumes.bench.facts import machine, versions
    from dcp_volumes.bench.harness import parse_size
    from dcp_volumes.bench.state import build_state, layout_for, write_pool
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=512 * MiB)
    p.add_argument("--ranks", default="1,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.ranks.split(",")]
    server = start_server("seaweedfs")
    try:
        bucket = f"coop-{uuid.uuid4().hex[:8]}"
        root = server.create_bucket(bucket)
        options = server.storage_options()
        with tempfile.TemporaryDirectory() as tmp:
            pool = os.path.join(tmp, "pool")
            write_pool(pool, args.size + MiB)
            specs = layout_for(args.size)
            url = f"{root}/replicated"
            import torch.distributed.checkpoint as dcp

            from dcp_volumes import VolumeWriter

            dcp.save(build_state(pool, specs, layout="replicated"),
                     storage_writer=VolumeWriter(url, storage_options=options), no_dist=True)
            spec = {"url": url, "options": options, "pool": pool, "size": args.size,
                    "timeout": 600.0}
            rows = []
            for rep in range(args.reps):
                for world in worlds:
                    for coop in ((False,) if world == 1 else (False, True)):
                        row = {**_measure(world, coop, spec), "rep": rep,
                               "command": " ".join(sys.argv), "size": args.size,
                               "versions": versions(), "machine": machine(),
                               "time": time.time()}
                        rows.append(row)
                        line = json.dumps(row)
                        print(line, flush=True)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(line + "\n")
            print(_table(rows))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
