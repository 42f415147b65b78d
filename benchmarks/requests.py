"""Requests a save and a load make, counted at the store, at 1-8 real ranks and projected to
64-4,096.

A moto server behind a :class:`~dcp_volumes.testing.faultproxy.FaultProxy` that logs every
request it forwards (:meth:`~dcp_volumes.testing.faultproxy.FaultProxy.record_requests`):
counted at the store, not inside the client. For each rank count (gloo ranks on this
machine), two ``dcp.save`` through ``VolumeWriter`` in the same processes (``save``: a job's first;
``save again``: any later one) and one ``dcp.load`` through ``VolumeReader`` of the same state (``--mib`` MiB sharded over the ranks as a DTensor, plus
small replicated tensors), sorted by kind (:mod:`dcp_volumes.testing.requests`).

The kind columns count the **control plane** (every request but the GETs and writes of
shard bytes); ``data`` counts the rest, which follow the bytes rather than the ranks.
Simulated rows (``"simulated": true``) are **not measured**: each control-plane kind's count
at 64-4,096 ranks is the least-squares line ``a + b·N`` through the measured counts at the
real rank counts (the fit and its largest residual are in the JSON: 0 means the counts are
exactly linear in N).
The planning rows time torch's own part of the plan phase at those sizes, in one process:
pickling N synthetic local save plans (``--tensors`` DTensor shards each, what
``gather_object`` sends to the coordinator), unpickling them, and
``DefaultSavePlanner.create_global_plan`` (measured, without the network).

Usage::

    .venv/bin/python benchmarks/requests.py --ranks 1 2 4 8 --out benchmarks/results/requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import subprocess
import sys
import time
import uuid
from typing import Any

import fsspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_volumes import VolumeReader, VolumeWriter
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.faultproxy import FaultProxy
from dcp_volumes.testing.requests import KINDS, Count, count
from dcp_volumes.testing.servers import start_server

SIMULATED = (64, 256, 1024, 4096)


def _state(world: int, mib: int, zeros: bool) -> dict[str, Any]:
    rows = max(world, (mib << 20) // (4 * 1024) // world * world)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(rows, 1024, generator=g)
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, [Shard(0)]),
            "r": {f"r{i}": torch.zeros(64) if zeros else torch.full((64,), float(i))
                  for i in range(4)}}


#: the object rank 0 asks for between a process's two saves: where the log is split
MARKER = "--second-save-starts--"


def _save(rank: int, world: int, url: str, options: dict[str, Any], mib: int) -> None:
    """Two saves in the same processes (a training job's first and a later one), with a
    marker request between them."""
    state = _state(world, mib, False)
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=options))
    dist.barrier()
    if rank == 0:
        fs, path = fsspec.url_to_fs(f"{url}-{MARKER}", **options)
        fs.exists(path)
    dist.barrier()
    dcp.save(state, storage_writer=VolumeWriter(f"{url}-again", storage_options=options))
    dist.barrier()


def _split(requests: list[tuple[str, str]]) -> tuple[list[tuple[str, str]],
                                                      list[tuple[str, str]]]:
    at = next(i for i, (_, target) in enumerate(requests) if MARKER in target)
    return requests[:at], [r for r in requests[at:] if MARKER not in r[1]]


def _load(rank: int, world: int, url: str, options: dict[str, Any], mib: int) -> bool:
    state = _state(world, mib, True)
    dcp.load(state, storage_reader=VolumeReader(url, storage_options=options))
    dist.barrier()
    return bool(torch.equal(state["r"]["r3"], torch.full((64,), 3.0)))


def _control_bytes(counted: Count, sizes: dict[str, int]) -> int:
    """Bytes of ``.metadata`` and the manifest moved (each GET or PUT moves the object)."""
    total = 0
    for (kind, obj), n in counted.by_object.items():
        if kind in ("GET", "PUT") and obj in ("metadata", "manifest"):
            total += n * sizes.get(obj, 0)
    return total


def _row(op: str, world: int, counted: Count, data_bytes: int, sizes: dict[str, int]
         ) -> dict[str, Any]:
    gib = data_bytes / (1 << 30)
    control = counted.control_by_kind()
    return {"op": op, "ranks": world, "simulated": False, **{k: control[k] for k in KINDS},
            "control": counted.control, "data": counted.total - counted.control,
            "total": counted.total, "all_by_kind": counted.as_dict(),
            "control_per_rank": round(counted.control / world, 3),
            "requests_per_gib": round(counted.total / gib, 1) if gib else None,
            "control_bytes": _control_bytes(counted, sizes), "data_bytes": data_bytes,
            "by_object": {f"{k} {o}": n for (k, o), n in sorted(counted.by_object.items())}}


def _sizes(root: str, options: dict[str, Any]) -> tuple[dict[str, int], int]:
    fs, path = fsspec.url_to_fs(root, **options)
    sizes, data = {}, 0
    for name, info in fs.find(path, detail=True).items():
        base = name.rsplit("/", 1)[-1]
        if base == ".metadata":
            sizes["metadata"] = int(info["size"])
        elif base.startswith(".dcpv-manifest-"):
            sizes["manifest"] = int(info["size"])
        elif base.endswith(".distcp"):
            data += int(info["size"])
    return sizes, data


def measure(world: int, proxy: FaultProxy, root: str, bucket: str, options: dict[str, Any],
            mib: int) -> list[dict[str, Any]]:
    """One save and one load on ``world`` real ranks, counted at the store."""
    url = f"{root}/requests-{world}-{uuid.uuid4().hex[:8]}"
    proxy.record_requests()
    run_ranks(world, _save, url, options, mib, timeout=900)
    first, again = _split(proxy.recorded_requests())
    saved, saved_again = count(first, bucket), count(again, bucket)
    proxy.record_requests()
    if not all(run_ranks(world, _load, url, options, mib, timeout=900)):
        raise AssertionError("a rank loaded different values")
    loaded = count(proxy.recorded_requests(), bucket)
    sizes, data = _sizes(url, options)
    return [_row("save", world, saved, data, sizes), _row("save again", world, saved_again,
                                                          data, sizes),
            _row("load", world, loaded, data, sizes)]


def project(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Simulated rows: each kind's least-squares line a + b·N through the measured rows."""
    out = []
    for op in ("save", "save again", "load"):
        real = [r for r in rows if r["op"] == op and not r["simulated"]]
        if not real:
            continue
        n = np.array([r["ranks"] for r in real], dtype=float)
        for world in SIMULATED:
            row: dict[str, Any] = {"op": op, "ranks": world, "simulated": True}
            row["data"] = None  # data requests follow the bytes, not the ranks: see per GiB
            for key in (*KINDS, "control", "control_bytes"):
                y = np.array([r[key] for r in real], dtype=float)
                b, a = np.polyfit(n, y, 1) if len(set(n)) > 1 else (0.0, y.mean())
                row[key] = round(float(a + b * world), 1)
                row.setdefault("model", {})[key] = (f"{a:.2f} + {b:.3f}·N (max residual "
                                                    f"{float(np.abs(a + b * n - y).max()):.2f})")
            row["control_per_rank"] = round(row["control"] / world, 4)
            out.append(row)
    return out


def recount(row: dict[str, Any]) -> dict[str, Any]:
    """A measured row again from its ``by_object`` counts (``--from``)."""
    counted = Count()
    for key, n in row["by_object"].items():
        kind, obj = key.split(" ", 1)
        counted.by_kind[kind] += n
        counted.by_object[(kind, obj)] += n
    out = _row(row["op"], row["ranks"], counted, row["data_bytes"], {})
    out["control_bytes"] = row["control_bytes"]
    return out


def from_jsonl(path: str) -> list[dict[str, Any]]:
    """The rows of an earlier run: measured ones recounted, projected again."""
    with open(path) as f:
        old = [json.loads(line) for line in f if line.strip()]
    rows = [recount(r) for r in old if r["op"] != "plan" and not r["simulated"]]
    return rows + project(rows) + [r for r in old if r["op"] == "plan"]


def _synthetic_plans(world: int, tensors: int) -> list[SavePlan]:
    plans = []
    props = TensorProperties(dtype=torch.float32)
    for r in range(world):
        chunk = ChunkStorageMetadata(offsets=torch.Size([r * 4, 0]), sizes=torch.Size([4, 1024]))
        items = [WriteItem(index=MetadataIndex(f"layer{i}.w", chunk.offsets),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                       size=torch.Size([4 * world, 1024])))
                 for i in range(tensors)]
        plans.append(SavePlan(items, planner_data={}))
    return plans


def planning_row(world: int, tensors: int) -> dict[str, Any]:
    """torch's gather + global save plan for ``world`` synthetic ranks, timed here."""
    plans = _synthetic_plans(world, tensors)
    start = time.perf_counter()
    blobs = [pickle.dumps(p) for p in plans]
    gathered = [pickle.loads(b) for b in blobs]
    pickled = time.perf_counter()
    DefaultSavePlanner().create_global_plan(gathered)
    done = time.perf_counter()
    return {"op": "plan", "ranks": world, "simulated": True, "tensors_per_rank": tensors,
            "gather_bytes": sum(len(b) for b in blobs), "pickle_s": round(pickled - start, 3),
            "global_plan_s": round(done - pickled, 3), "plan_s": round(done - start, 3)}


def _dash(value: Any) -> str:
    return "—" if value is None else str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["op", "ranks", *KINDS, "control", "control/rank", "control bytes", "data",
            "requests/GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["op"] == "plan":
            continue
        ranks = f"{r['ranks']}{' (sim.)' if r['simulated'] else ''}"
        cells = [r["op"], ranks, *(r[k] for k in KINDS), r["control"],
                 r["control_per_rank"], r["control_bytes"], _dash(r.get("data")),
                 _dash(r.get("requests_per_gib"))]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    plan = [r for r in rows if r["op"] == "plan"]
    if plan:
        lines += ["", "| ranks (synthetic plans) | gather bytes | pickle s | global plan s |",
                  "|---|---|---|---|"]
        lines += [f"| {r['ranks']} | {r['gather_bytes']} | {r['pickle_s']} | "
                  f"{r['global_plan_s']} |" for r in plan]
    return "\n".join(lines)


def _provenance() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=False,
                            text=True).stdout.strip()
    return {"command": " ".join(sys.argv), "commit": commit, "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--mib", type=int, default=16, help="size of the sharded tensor")
    ap.add_argument("--plan-ranks", type=int, nargs="*", default=list(SIMULATED))
    ap.add_argument("--tensors", type=int, default=8, help="shards per synthetic rank plan")
    ap.add_argument("--out", default=None, help="append JSON lines here too")
    ap.add_argument("--from", dest="source", default=None,
                    help="no run: the table again from this JSON-lines file")
    args = ap.parse_args(argv)
    if args.source:
        print(markdown(from_jsonl(args.source)))
        return 0
    server = start_server("moto")
    proxy = FaultProxy(server)
    proxy.start()
    try:
        bucket = f"req-{uuid.uuid4().hex[:8]}"
        root = server.create_bucket(bucket)
        options = server.storage_options(endpoint_url=proxy.endpoint_url)
        rows = [r for w in args.ranks for r in measure(w, proxy, root, bucket, options,
                                                       args.mib)]
    finally:
        proxy.stop()
        server.stop()
    rows += project(rows) + [planning_row(w, args.tensors) for w in args.plan_ranks]
    meta = _provenance()
    lines = [json.dumps({**r, **meta}) for r in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
