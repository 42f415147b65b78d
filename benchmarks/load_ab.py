"""Interleaved A/B of 1 GiB loads: dcp_volumes trees (``--tree NAME=DIR``, each imported in
its own subprocess with ``PYTHONPATH=DIR``) and s3torchconnector, against one SeaweedFS.

One checkpoint per contender is saved once (a ``vol`` tree's with its own writer, defaults;
s3torchconnector's with its writer, 8 threads; ``--one-save``: every tree loads the last
tree's), then ``--rounds`` rounds load each once, in a shuffled order, each load in a fresh
process that first saves and loads a tiny state (as the bench's workers warm their clients;
``--cold``: not); with ``--saves`` each round saves per contender too (timed, after the
warm-up) and loads that save. Wall seconds and the process's client CPU seconds (user + sys
over the ``dcp.save`` / ``dcp.load`` call) per round, then medians and per-round ratios
against the first tree, with the load average.

    PYTHONPATH=. .venv/bin/python benchmarks/load_ab.py --size 1GiB --rounds 3 \\
        --tree old=/work/old --tree new=. --s3tc --one-save --out /tmp/load-ab.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _state(size: int, empty: bool) -> dict[str, Any]:
    import torch

    n = size // 16 // 4
    if empty:
        return {f"t{i}": torch.empty(n) for i in range(16)}
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.rand(n, generator=g) for i in range(16)}


def _io(family: str, url: str, opts: dict[str, Any], write: bool) -> Any:
    if family == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        cfg = S3ClientConfig(force_path_style=True)
        if write:
            return S3StorageWriter(region="us-east-1", path=url, thread_count=8,
                                   s3client_config=cfg)
        return S3StorageReader(region="us-east-1", path=url, s3client_config=cfg)
    from dcp_volumes import VolumeReader, VolumeWriter

    return (VolumeWriter(url, storage_options=opts) if write
            else VolumeReader(url, storage_options=opts))


def child(args: argparse.Namespace) -> int:
    """One save or load in this process; prints a JSON line."""
    import torch
    import torch.distributed.checkpoint as dcp

    opts = json.loads(os.environ["LOAD_AB_OPTS"])
    if args.warm:  # imports, sessions, connection pools, as the bench's workers do
        tiny = _state(16 << 20, empty=False)
        dcp.save(tiny, storage_writer=_io(args.family, args.warm, opts, True), no_dist=True)
        dcp.load(tiny, storage_reader=_io(args.family, args.warm, opts, False), no_dist=True)
    state = _state(args.size, empty=args.child == "load")
    io = _io(args.family, args.url, opts, write=args.child == "save")
    c0, t0 = _cpu(), time.perf_counter()
    if args.child == "save":
        dcp.save(state, storage_writer=io, no_dist=True)
    else:
        dcp.load(state, storage_reader=io, no_dist=True)
    c1, t1 = _cpu(), time.perf_counter()
    if args.child == "load":
        want = _state(args.size, empty=False)
        assert all(torch.equal(state[k], want[k]) for k in want), "load differs"
    print(json.dumps({"s": t1 - t0, "cpu_s_per_gib": (c1 - c0) / (args.size / (1 << 30))}))
    return 0


def _run(what: str, family: str, tree: str, url: str, size: int, env: dict[str, str],
         warm: str = "") -> dict[str, Any]:
    for attempt in range(2):  # once more after a failure (a store timing out under load)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--family", family,
               "--url", url + "-again" * attempt, "--size", str(size),
               "--warm", warm and warm + "-again" * attempt]
        out = subprocess.run(cmd, check=False, env={**env, "PYTHONPATH": os.path.abspath(tree)},
                             capture_output=True, text=True, timeout=900)
        if not out.returncode:
            break
        print(f"{what} {family} {tree} failed once: {out.stderr.strip().splitlines()[-1]}",
              flush=True)
    if out.returncode:
        raise RuntimeError(f"{what} {family} {tree} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "url": cmd[cmd.index("--url") + 1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=lambda t: int(float(t[:-3]) * (1 << 30)) if t.endswith(
        "GiB") else int(float(t[:-3]) * (1 << 20)) if t.endswith("MiB") else int(t),
        default=1 << 30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR")
    ap.add_argument("--s3tc", action="store_true")
    ap.add_argument("--one-save", action="store_true",
                    help="every tree loads the one checkpoint the last tree saved")
    ap.add_argument("--out")
    ap.add_argument("--child", choices=("save", "load"))
    ap.add_argument("--family", default="vol")
    ap.add_argument("--url")
    ap.add_argument("--warm", default="", help="(child) URL of a tiny warm-up save + load")
    ap.add_argument("--saves", action="store_true",
                    help="time a save per contender and round too (each round's load "
                         "reads that round's save)")
    ap.add_argument("--cold", action="store_true", help="no warm-up in each process")
    args = ap.parse_args()
    if args.child:
        return child(args)
    from dcp_volumes.testing.servers import start_server

    server = start_server("seaweedfs")
    try:
        root = server.create_bucket("dcpv-loadab")
        env = {**os.environ, **server.env(),
               "LOAD_AB_OPTS": json.dumps(server.storage_options())}
        cont = [(n, "vol", d) for n, d in (t.split("=", 1) for t in args.tree)]
        if args.s3tc:
            cont.append(("s3tc-t8", "s3tc", cont[-1][2]))
        where = {n: f"{root}/{n}" for n, _, _ in cont}
        if args.one_save:
            last = [n for n, f, _ in cont if f == "vol"][-1]
            where.update({n: f"{root}/{last}" for n, f, _ in cont if f == "vol"})
        for name, fam, tree in cont:
            if not args.saves and where[name] == f"{root}/{name}":
                print("save", name, _run("save", fam, tree, where[name], args.size, env),
                      flush=True)
        rows: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            order = cont[:]
            random.Random(rnd).shuffle(order)
            for name, fam, tree in order:
                warm = "" if args.cold else f"{root}/{name}-warm-{rnd}"
                row = {"round": rnd, "name": name}
                if args.saves:
                    url = f"{root}/{name}-r{rnd}"
                    saved = _run("save", fam, tree, url, args.size, env, warm)
                    row |= {"save_s": saved["s"], "save_cpu_s_per_gib": saved["cpu_s_per_gib"]}
                    url = saved["url"]
                    warm = warm and f"{warm}-load"
                else:
                    url = where[name]
                r = _run("load", fam, tree, url, args.size, env, warm)
                row |= {**r, "loadavg": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    base = cont[0][0]
    for name, _, _ in cont:
        mine = [r for r in rows if r["name"] == name]
        ref = {r["round"]: r for r in rows if r["name"] == base}
        if args.saves:
            sv = [m["save_s"] for m in mine]
            sc = [m["save_cpu_s_per_gib"] for m in mine]
            sr = [m["save_cpu_s_per_gib"] / ref[m["round"]]["save_cpu_s_per_gib"]
                  for m in mine]
            tr = [m["save_s"] / ref[m["round"]]["save_s"] for m in mine]
            print(f"{name}: save s median {statistics.median(sv):.2f} "
                  f"({', '.join(f'{x:.2f}' for x in sv)}); save CPU s/GiB median "
                  f"{statistics.median(sc):.2f} ({', '.join(f'{x:.2f}' for x in sc)}); "
                  f"save CPU / {base} per round {', '.join(f'{x:.2f}' for x in sr)} "
                  f"(median {statistics.median(sr):.2f}); save time / {base} median "
                  f"{statistics.median(tr):.2f}")
        ratio = [m["s"] / ref[m["round"]]["s"] for m in mine]
        secs = [m["s"] for m in mine]
        cpus = [m["cpu_s_per_gib"] for m in mine]
        cpu = statistics.median(cpus)
        cr = [m["cpu_s_per_gib"] / ref[m["round"]]["cpu_s_per_gib"] for m in mine]
        print(f"{name}: load s median {statistics.median(secs):.2f} "
              f"({', '.join(f'{x:.2f}' for x in secs)}); CPU s/GiB median {cpu:.2f} "
              f"({', '.join(f'{x:.2f}' for x in cpus)}); CPU / {base} median "
              f"{statistics.median(cr):.2f}; "
              f"time / {base} per round {', '.join(f'{x:.2f}' for x in ratio)} "
              f"(median {statistics.median(ratio):.2f})")
    print("load average:", ", ".join(f"{r['loadavg']:.1f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
