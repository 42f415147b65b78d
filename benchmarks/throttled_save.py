"""Multi-rank saves through a per-prefix request-rate limit, reaction to throttling on vs off.

A local SeaweedFS behind the fault proxy, whose :class:`PrefixRateLimit` gives each key prefix
(an object's directory) ``--rate`` requests per second (``--burst`` saved up) and answers
``503 SlowDown`` above it, as S3 does per partitioned prefix. ``--ranks`` gloo ranks each save
``--files`` small tensors (``--kib`` KiB each) into as many shard files (one PUT each), so the
whole save is a few hundred requests against one prefix: bound by the limit, not by bytes.

Variants, interleaved within each repetition (the order alternates):

- ``on``: the defaults (``TransferOptions(throttle_backoff=True)``);
- ``off``: ``throttle_backoff=False``: retries with full-jitter backoff are the only reaction;
- ``hashed``: the defaults plus ``key_layout="hashed"`` (shard files over hashed prefixes).

Per run: whether every rank's save succeeded, client retries per part (``SaveStats``), the
requests the proxy throttled, and the **limit efficiency** of the upload window: shard PUTs
accepted ÷ (``rate`` × seconds from the first accepted shard PUT to the last + ``burst``),
i.e. the fraction of what the limit allowed that the save used (other requests of the save
in the same prefix -- live records -- are not counted, so it is a lower bound).

Usage::

    .venv/bin/python benchmarks/throttled_save.py --ranks 8 --rate 50 --reps 3 \\
        --out benchmarks/results/throttled.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import torch

from dcp_volumes import __version__
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.faultproxy import FaultProxy, PrefixRateLimit
from dcp_volumes.testing.servers import start_server
from dcp_volumes.testing.throttling import save_own_keys

VARIANTS: dict[str, dict[str, Any]] = {
    "on": {"throttle_backoff": True},
    "off": {"throttle_backoff": False},
    "hashed": {"throttle_backoff": True, "key_layout": "hashed"},
}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(__file__) or ".")
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def one_run(proxy: FaultProxy, root: str, variant: str, args: argparse.Namespace
            ) -> dict[str, Any]:
    limit = proxy.add_rate_limit(PrefixRateLimit(rate=args.rate, burst=args.burst))
    # Counts the shard PUTs the limit let through (installed after it: a throttled request
    # never gets here), with a rate no run reaches.
    shards = proxy.add_rate_limit(PrefixRateLimit(rate=1e9, burst=1e9, method="PUT",
                                                  path_regex=r"\.distcp", depth=1))
    url = f"{root}/{variant}-{uuid.uuid4().hex[:8]}"
    try:
        start = time.monotonic()
        out = run_ranks(args.ranks, save_own_keys, url, proxy.storage_options(),
                        VARIANTS[variant], args.files, args.kib, timeout=900)
        elapsed = time.monotonic() - start
        stats = proxy.stats
        limited, counted = stats.rate_limit(limit), stats.rate_limit(shards)
    finally:
        proxy.remove_rate_limit(limit)
        proxy.remove_rate_limit(shards)
    counts = next(iter(counted.prefixes.values()))
    window = counts.span_s
    parts = sum(o.get("parts", 0) for o in out)
    retries = sum(o.get("retries", 0) for o in out)
    return {
        "variant": variant,
        "ok": all(o["error"] is None for o in out),
        "errors": [o["error"] for o in out if o["error"]],
        "parts": parts,
        "retries": retries,
        "retries_per_part": retries / parts if parts else None,
        "throttled": limited.throttled,
        # the proxy's count: includes ranks whose save failed (they report no SaveStats)
        "throttled_per_part": limited.throttled / (args.ranks * args.files),
        "accepted": limited.accepted,
        "prefixes": len(limited.prefixes),
        "shard_puts": counts.accepted,
        "window_s": window,
        # one prefix's limit is what the flat layout allows; the hashed one spreads over many
        "efficiency": (counts.accepted / (args.rate * window + args.burst)
                       if window and "key_layout" not in VARIANTS[variant] else None),
        "save_s": max(o["wall_s"] for o in out),
        "run_s": elapsed,
        "cuts": [o["throttle_cuts"] for o in out],
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        (f"{args.ranks} ranks × {args.files} files × {args.kib} KiB; limit {args.rate:g} req/s "
         f"per prefix (burst {args.burst:g}); medians of {args.reps}"),
        "",
        ("| variant | saves ok | 503s / part (proxy) | retries / part (ranks that finished) "
         "| prefixes | upload window s | limit efficiency (each run) | save s |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in args.variants:
        runs = [r for r in rows if r["variant"] == variant]
        if not runs:
            continue

        def med(key: str, runs: list[dict[str, Any]] = runs) -> str:
            values = [r[key] for r in runs if r[key] is not None]
            return f"{statistics.median(values):.2f}" if values else "n/a"

        ok = sum(r["ok"] for r in runs)
        each = ", ".join(f"{r['efficiency']:.2f}" for r in runs if r["efficiency"] is not None)
        lines.append(
            f"| {variant} | {ok}/{len(runs)} | {med('throttled_per_part')} | "
            f"{med('retries_per_part')} | {med('prefixes')} | {med('window_s')} | "
            f"{med('efficiency')}{f' ({each})' if each else ''} | {med('save_s')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rate", type=float, default=50.0, help="requests/s per prefix")
    p.add_argument("--burst", type=float, default=5.0)
    p.add_argument("--files", type=int, default=32, help="shard files (PUTs) per rank")
    p.add_argument("--kib", type=int, default=64, help="KiB per tensor (one per file)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="on,off", help="comma-separated: on, off, hashed")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--report", default=None, metavar="JSONL",
                   help="only print the table of an earlier run's JSON lines")
    args = p.parse_args()
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    if args.report:
        with open(args.report) as f:
            earlier = [json.loads(line) for line in f if line.strip()]
        for row in earlier:  # lines from before the proxy-side count was recorded
            row.setdefault("throttled_per_part", row["throttled"] / (args.ranks * args.files))
        print(f"`{earlier[0]['command']}` at {earlier[0]['commit']}")
        print()
        print(table(earlier, args))
        return
    command = " ".join([os.path.relpath(sys.executable), *sys.argv])
    facts = {"command": command, "commit": _commit(), "dcp_volumes": __version__,
             "torch": torch.__version__, "python": platform.python_version(),
             "cpus": os.cpu_count(), "machine": platform.machine()}
    server = start_server("seaweedfs")
    proxy = FaultProxy(server)
    proxy.start()
    rows: list[dict[str, Any]] = []
    try:
        bucket = f"throttled-{uuid.uuid4().hex[:8]}"
        root = server.create_bucket(bucket)
        for rep in range(args.reps):
            order = args.variants if rep % 2 == 0 else list(reversed(args.variants))
            for variant in order:
                row = {**one_run(proxy, root, variant, args), "rep": rep, **facts}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        proxy.stop()
        server.stop()
    print()
    print(f"`{command}` at {facts['commit']} (torch {facts['torch']}, {facts['cpus']} CPUs)")
    print()
    print(table(rows, args))


if __name__ == "__main__":
    main()
