"""Lightning ModelParallelStrategy checkpoints: dcp_volumes' integration vs Lightning's own route.

Lightning's sharded save (``ModelParallelStrategy`` / FSDP2, Trainer and Fabric alike) wraps
its path in ``pathlib.Path``, so an ``s3://`` URL becomes the local directory ``s3:/...``: it
cannot write to an object store. Its own route to a store is therefore: its local-directory
save (``dcp.save`` + ``meta.pt``), then an upload with s3fs (every rank puts its own shard
file, rank 0 also ``.metadata`` and ``meta.pt``); resume: download with s3fs, then Lightning's
local load. The integration saves
and loads straight through ``VolumeWriter`` / ``VolumeReader``.

Lightning's resume reads a local directory: rank 0 downloads the checkpoint once (both ranks
share this machine, as ranks of one node share its disk), then both load.

2 gloo ranks hold an FSDP2 model and AdamW state (``--size`` of state in all, model + two
optimizer moments), on a local SeaweedFS, ``direct`` and ``s3-like`` (the bench's
FaultProxy: ``--delay`` first-byte delay, ``--bandwidth`` per connection). Contenders run
interleaved, ``--reps`` times; each time is rank 0's, from a barrier before to a barrier
after (every rank done). Prints JSON lines (also to ``--out``) and a markdown table::

    python benchmarks/integration_lightning.py --size 192MiB --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

MiB = 1 << 20


def _model(total_bytes: int) -> Any:
    import torch

    width = 1024
    # params + exp_avg + exp_avg_sq = total_bytes
    layers = max(1, total_bytes // 3 // (width * width * 4))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(layers)])


def _rank(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    import warnings

    warnings.filterwarnings("ignore")
    import s3fs
    import torch
    import torch.distributed as dist
    from lightning.fabric.strategies.model_parallel import _load_checkpoint, _save_checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_volumes.integrations.lightning import VolumeFabricModelParallelStrategy

    mesh = init_device_mesh("cpu", (world,))
    model = _model(spec["size"])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()
    state = {"model": model, "optimizer": optim, "step": 1, "loops": {"epoch": 0}}
    out: list[dict[str, Any]] = []
    # made once per run, as a training job does (outside the timings)
    strategies = {p: VolumeFabricModelParallelStrategy(f"{spec['root']}/{p}-dcp-volumes",
                                                       lambda m, _: m, storage_options=o)
                  for p, o in spec["profiles"].items()}
    filesystems = {p: s3fs.S3FileSystem(**o) for p, o in spec["profiles"].items()}
    for rep in range(-1, spec["reps"]):  # rep -1: a warm-up, not recorded
        for profile in spec["profiles"]:
            fs, strategy = filesystems[profile], strategies[profile]
            for contender in ("lightning+s3fs", "dcp-volumes"):
                root = f"{spec['root']}/{profile}-lightning-{rep + 1}"
                url = strategy.url_for(rep + 2)
                t = {}
                dist.barrier()
                start = time.perf_counter()
                if contender == "dcp-volumes":
                    strategy.save_checkpoint(url, state)
                else:
                    local = os.path.join(spec["tmp"], f"{profile}-{rep}")
                    _save_checkpoint(path=__import__("pathlib").Path(local), state=state,
                                     full_state_dict=False, rank=rank)
                    names = [f"__{rank}_0.distcp"] + ([".metadata", "meta.pt"] if rank == 0
                                                      else [])
                    fs.put([os.path.join(local, n) for n in names],
                           [f"{root}/step-1/{n}" for n in names])
                dist.barrier()
                t["save_s"] = time.perf_counter() - start
                start = time.perf_counter()
                if contender == "dcp-volumes":
                    strategy.load_checkpoint(url, {"model": model, "optimizer": optim,
                                                   "step": 0, "loops": None})
                else:
                    # one copy per node (both ranks share this machine): rank 0 fetches it
                    mine = os.path.join(spec["tmp"], f"get-{profile}-{rep}")
                    if rank == 0:
                        os.makedirs(mine, exist_ok=True)
                        names = [f"__{r}_0.distcp" for r in range(world)]
                        names += [".metadata", "meta.pt"]
                        fs.get([f"{root}/step-1/{n}" for n in names],
                               [os.path.join(mine, n) for n in names])
                    dist.barrier()
                    _load_checkpoint(path=__import__("pathlib").Path(mine),
                                     state={"model": model, "optimizer": optim, "step": 0,
                                            "loops": None})
                dist.barrier()
                t["load_s"] = time.perf_counter() - start
                if rep >= 0:
                    out.append({"contender": contender, "profile": profile, "rep": rep, **t})
    for strategy in strategies.values():
        strategy.volumes.close()
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| profile | contender | save s (median, min-max) | resume s (median, min-max) |",
             "|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["profile"], r["contender"]), []).append(r)
    for (profile, contender), rs in groups.items():
        cells = []
        for key in ("save_s", "load_s"):
            vals = [r[key] for r in rs]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
        lines.append(f"| {profile} | {contender} | {cells[0]} | {cells[1]} |")
    for profile in dict.fromkeys(r["profile"] for r in rows):
        ours = groups[(profile, "dcp-volumes")]
        theirs = groups[(profile, "lightning+s3fs")]
        for key, word in (("save_s", "save"), ("load_s", "resume")):
            ratio = (statistics.median(r[key] for r in theirs)
                     / statistics.median(r[key] for r in ours))
            lines.append(f"| {profile} | lightning ÷ dcp-volumes, {word} | {ratio:.2f}x | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="192MiB", help="state size, e.g. 192MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.03)
    parser.add_argument("--bandwidth", type=float, default=10e6)
    parser.add_argument("--out", default="benchmarks/results/integration-lightning.jsonl")
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    from dcp_volumes.bench.facts import machine, versions
    from dcp_volumes.bench.target import ProfileProxy
    from dcp_volumes.testing.dist import run_ranks
    from dcp_volumes.testing.servers import start_server

    size = int(args.size.removesuffix("MiB")) * MiB
    server = start_server("seaweedfs")
    proxy = None
    try:
        bucket = f"lbench{uuid.uuid4().hex[:8]}"
        root = server.create_bucket(bucket)
        proxy = ProfileProxy(server.endpoint_url, args.delay, args.bandwidth)
        profiles = {"direct": server.storage_options(),
                    "s3-like": server.storage_options(endpoint_url=proxy.endpoint_url)}
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"size": size, "reps": args.reps, "root": root, "tmp": tmp,
                    "profiles": profiles}
            rows = run_ranks(2, _rank, spec, timeout=3000)[0]
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
    facts = {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
             "size_bytes": size, "ranks": 2, "delay_s": args.delay,
             "bandwidth_Bps": args.bandwidth, "versions": versions(), "machine": machine()}
    with open(args.out, "a") as f:
        for row in rows:
            line = json.dumps({**row, **facts})
            print(line)
            f.write(line + "\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
