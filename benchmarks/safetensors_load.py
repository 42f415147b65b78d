"""Safetensors in SeaweedFS into FSDP2 ranks: ``SafetensorsReader`` against every rank
downloading the files (issue 19, part 2).

Writes a model-like state (``--layers`` blocks of an up and a down projection, fp32, plus a
norm each; 512 MiB at the default 4 layers of 2048×8192) as numbered safetensors files plus
``model.safetensors.index.json``, one file per layer, uploads them to a local SeaweedFS, then
for each world size, interleaved, ``--reps`` times:

- ``reader``: ``dcp.load(state, storage_reader=SafetensorsReader(url))`` into a
  ``fully_shard`` model on a CPU gloo mesh (each rank fetches the element ranges of its
  shards);
- ``download``: what a user does today: every rank ``s3fs.get``s every file to local disk,
  ``safetensors.torch.load_file``s each and copies its ``torch.chunk`` of every tensor into
  its local shard.

Time: from a barrier before to a barrier after (all ranks done); process start-up and
imports are outside it. Bytes: what each rank fetched from the store, over the bytes of its
shards. One JSON line per run, then a markdown table of medians::

    python benchmarks/safetensors_load.py --ranks 2,4 --reps 3 \\
        --out benchmarks/results/safetensors-load.jsonl
"""

from __future__ import annotations

import argparse
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


def _model(spec: dict[str, Any]) -> Any:
    import torch

    h, f = spec["hidden"], spec["ffn"]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(h, f, bias=False)
            self.down = torch.nn.Linear(f, h, bias=False)
            self.norm = torch.nn.LayerNorm(h, bias=False)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(spec["layers"]))

    return Model()


def _tensors(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    h, f = spec["hidden"], spec["ffn"]
    out = {}
    for i in range(spec["layers"]):
        out[f"layers.{i}.up.weight"] = torch.randn(f, h, generator=g)
        out[f"layers.{i}.down.weight"] = torch.randn(h, f, generator=g)
        out[f"layers.{i}.norm.weight"] = torch.randn(h, generator=g)
    return out


def _sharded(world: int, spec: dict[str, Any]) -> Any:
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _model(spec)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return get_model_state_dict(model)


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_volumes.export import SafetensorsReader

    state = _sharded(world, spec)
    needed = sum(v.to_local().nbytes for v in state.values())
    SafetensorsReader(spec["url"], storage_options=spec["options"]).read_metadata()  # warm-up
    dist.barrier()
    start = time.monotonic()
    if spec["route"] == "reader":
        reader = SafetensorsReader(spec["url"], storage_options=spec["options"])
        dcp.load(state, storage_reader=reader)
        stats = reader.last_stats.as_dict() if reader.last_stats else {}
        fetched = stats.get("bytes_fetched", 0)
    else:
        fetched = _download_route(rank, world, state, spec)
    dist.barrier()
    wall = time.monotonic() - start
    want = _tensors(spec)
    ok = all(torch.equal(v.to_local(), torch.chunk(want[k], world, dim=0)[rank])
             for k, v in state.items())
    return {"rank": rank, "s": wall, "fetched": fetched, "needed": needed, "ok": ok}


def _download_route(rank: int, world: int, state: dict[str, Any], spec: dict[str, Any]
                    ) -> int:
    import fsspec
    import torch
    from safetensors.torch import load_file

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **spec["options"])
    local = tempfile.mkdtemp(prefix=f"st-bench-{rank}-")
    try:
        fs.get(spec["url"].removeprefix("s3://") + "/", local + "/", recursive=True)
        fetched = 0
        for name in sorted(os.listdir(local)):
            path = os.path.join(local, name)
            fetched += os.path.getsize(path)
            if not name.endswith(".safetensors"):
                continue
            for key, full in load_file(path).items():
                if key in state:
                    state[key].to_local().copy_(torch.chunk(full, world, dim=0)[rank])
        return fetched
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _write(spec: dict[str, Any], local: str) -> int:
    from safetensors.torch import save_file

    tensors = _tensors(spec)
    weight_map = {}
    n = spec["layers"]
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")}
        save_file(part, os.path.join(local, fname))
        weight_map.update({k: fname for k in part})
    total = sum(v.nbytes for v in tensors.values())
    with open(os.path.join(local, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _table(rows: list[dict[str, Any]]) -> str:
    out = [("| ranks | route | time s (median, min–max) | fetched ÷ needed per rank "
            "(max over ranks) | MiB from the store (all ranks) |"),
           "|---|---|---|---|---|"]
    for world in sorted({r["world"] for r in rows}):
        for route in ("reader", "download"):
            rs = [r for r in rows if r["world"] == world and r["route"] == route]
            if not rs:
                continue
            t = [r["s"] for r in rs]
            out.append(f"| {world} | {route} | {statistics.median(t):.2f} ({min(t):.2f}–"
                       f"{max(t):.2f}) | {statistics.median(r['ratio'] for r in rs):.4f} | "
                       f"{statistics.median(r['store_mib'] for r in rs):.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dcp_volumes.bench.facts import machine, versions
    from dcp_volumes.testing.dist import run_ranks
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    args = p.parse_args(argv)
    spec: dict[str, Any] = {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn}
    server = start_server("seaweedfs")
    rows = []
    try:
        root = server.create_bucket(f"stl-{uuid.uuid4().hex[:8]}")
        spec["options"] = server.storage_options()
        spec["url"] = f"{root}/model"
        with tempfile.TemporaryDirectory() as tmp:
            total = _write(spec, tmp)
            import fsspec

            fs = fsspec.filesystem("s3", skip_instance_cache=True, **spec["options"])
            fs.put(tmp + "/", spec["url"].removeprefix("s3://") + "/", recursive=True)
        for rep in range(args.reps):
            for world in (int(w) for w in args.ranks.split(",")):
                for route in ("reader", "download"):
                    res = run_ranks(world, _rank, {**spec, "route": route}, timeout=580)
                    row = {"route": route, "world": world, "rep": rep, "model_bytes": total,
                           "s": max(r["s"] for r in res), "ok": all(r["ok"] for r in res),
                           "ratio": max(r["fetched"] / r["needed"] for r in res),
                           "store_mib": sum(r["fetched"] for r in res) / MiB,
                           "ranks": res, "command": " ".join(sys.argv),
                           "versions": versions(), "machine": machine(), "time": time.time()}
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
