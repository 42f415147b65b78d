"""Issue 28's verdicts from a ``dcp-volumes bench`` run: per-round paired ratios of save time
and client CPU per GiB, ours against s3torchconnector and the raw ceiling.

    python benchmarks/cpu_ratios.py DIR/results.jsonl [--ours vol-disk] [--s3tc s3tc-t8]

The raw ceiling of a round is the raw-obstore contender (any ``-cN``) with the shortest save
of that round; its CPU per GiB is that contender's. Prints a markdown table per round and
the medians, with the issue's targets: save time <= 1.0x s3tc and <= 1.05x the ceiling,
save CPU/GiB <= 1.3x raw obstore's, load CPU/GiB <= 1.0x, loads >= 1.2x faster than s3tc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

GiB = 1 << 30

#: (name, value of a round, target, whether lower is better)
CHECKS = [
    ("save time / s3tc", lambda o, s, r: o["save_s"] / s["save_s"], 1.0, True),
    ("save time / raw ceiling", lambda o, s, r: o["save_s"] / r["save_s"], 1.05, True),
    ("save CPU per GiB / raw obstore", lambda o, s, r: o["save_cpu"] / r["save_cpu"], 1.3, True),
    ("load CPU per GiB / raw obstore", lambda o, s, r: o["load_cpu"] / r["load_cpu"], 1.0, True),
    ("load speed-up over s3tc", lambda o, s, r: s["load_s"] / o["load_s"], 1.2, False),
]


def rounds(path: str, profile: str) -> dict[int, dict[str, dict[str, float]]]:
    """rep -> contender -> {save_s, load_s, save_cpu, load_cpu} (CPU in s per GiB)."""
    out: dict[int, dict[str, dict[str, float]]] = defaultdict(dict)
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            res = rec.get("result") or {}
            if rec.get("profile") != profile or "save_s" not in res:
                continue
            gib = rec["size_bytes"] / GiB
            out[rec["rep"]][rec["contender"]] = {
                "save_s": res["save_s"], "load_s": res.get("load_s") or float("nan"),
                "save_cpu": res["save_cpu_s"] / gib,
                "load_cpu": (res.get("load_cpu_s") or float("nan")) / gib}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--ours", default="vol-disk")
    ap.add_argument("--s3tc", default="s3tc-t8")
    ap.add_argument("--profile", default="direct")
    args = ap.parse_args(argv)
    per: dict[str, list[float]] = defaultdict(list)
    print("| round | contender | save s | save CPU s/GiB | load s | load CPU s/GiB |")
    print("|---|---|---|---|---|---|")
    for rep, got in sorted(rounds(args.results, args.profile).items()):
        raws = {k: v for k, v in got.items() if k.startswith("raw-obstore")}
        if args.ours not in got or args.s3tc not in got or not raws:
            continue
        ceiling = min(raws, key=lambda k: raws[k]["save_s"])
        for name in (args.ours, args.s3tc, ceiling):
            v = got[name]
            print(f"| {rep + 1} | {name} | {v['save_s']:.2f} | {v['save_cpu']:.2f} | "
                  f"{v['load_s']:.2f} | {v['load_cpu']:.2f} |")
        for label, fn, _, _ in CHECKS:
            per[label].append(fn(got[args.ours], got[args.s3tc], got[ceiling]))
    print("\n| paired ratio | per round | median | target | met |\n|---|---|---|---|---|")
    for label, _, target, lower in CHECKS:
        vals = per.get(label) or []
        if not vals:
            continue
        med = statistics.median(vals)
        met = med <= target if lower else med >= target
        print(f"| {label} | {', '.join(f'{v:.2f}' for v in vals)} | {med:.2f} | "
              f"{'<=' if lower else '>='} {target} | {'yes' if met else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
