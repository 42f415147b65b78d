"""Export of a two-rank checkpoint SeaweedFS → SeaweedFS to Hugging Face safetensors: ours
against the route a user has today, and against the raw download + upload ceilings.

For each size, one checkpoint is saved on 2 gloo ranks (16 fp32 weights, each a DTensor
sharded on dim 0, as FSDP2 leaves them) to a local SeaweedFS; then, interleaved, ``--reps``
times, each contender runs in its own fresh process:

- ``ours``: ``dcp_volumes.export_safetensors(src, dest)`` (store to store, streaming);
- ``today``: s3fs downloads the checkpoint to local disk, a full ``dcp.load`` into memory
  (``_EmptyStateDictLoadPlanner``, as ``format_utils.dcp_to_torch_save`` does it, with
  torch's ``FileSystemReader``), ``safetensors.torch.save_file``, s3fs uploads the file;
- ``ceiling``: raw s3fs GETs of the checkpoint's objects (concurrent, into memory), then a
  raw s3fs PUT (multipart) of as many bytes: "download + upload ceiling" is their sum.

Each contender reports its wall time and its peak RSS (sampled, and the kernel's
``ru_maxrss``) above the RSS it had after its imports. Prints one JSON line per run and a
markdown table of medians::

    python benchmarks/export_safetensors.py --sizes 256MiB,1GiB --reps 3 \\
        --out benchmarks/results/export-safetensors.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

MiB = 1 << 20
LAYERS = 16
CONTENDERS = ("ours", "today", "ceiling")


def _save_rank(rank: int, world: int, url: str, opts: dict[str, Any], size: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dcp_volumes import VolumeWriter

    mesh = init_device_mesh("cpu", (world,))
    cols = 1024
    rows = size // LAYERS // 4 // cols
    state = {}
    for i in range(LAYERS):
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.randn(rows // world, cols, generator=g)
        state[f"model.layers.{i:02d}.weight"] = DTensor.from_local(local, mesh, [Shard(0)])
    state["model.step"] = torch.tensor(7)
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=opts))


def _measure(fn: Any) -> dict[str, Any]:
    import gc

    from dcp_volumes.bench.measure import RssSampler, rss

    gc.collect()
    base = rss()
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        extra = fn() or {}
        wall = time.perf_counter() - t0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"wall_s": wall, "rss_base_mib": base / MiB,
            "rss_peak_mib": (max(sampler.peak, maxrss) - base) / MiB, **extra}


def _ours(spec: dict[str, Any]) -> dict[str, Any]:
    from dcp_volumes.export import export_safetensors

    def run() -> dict[str, Any]:
        r = export_safetensors(spec["src"], spec["dest"], storage_options=spec["opts"])
        return {"bytes": r.bytes, "bytes_fetched": r.bytes_fetched}
    return _measure(run)


def _today(spec: dict[str, Any]) -> dict[str, Any]:
    import s3fs
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    fs = s3fs.S3FileSystem(**spec["opts"])
    work = tempfile.mkdtemp(dir=spec["tmp"])

    def run() -> dict[str, Any]:
        marks = {}
        t = time.perf_counter()
        fs.get(spec["src"].removeprefix("s3://") + "/", work + "/ckpt/", recursive=True)
        marks["download_s"] = time.perf_counter() - t
        sd: dict[str, Any] = {}
        t = time.perf_counter()
        # what format_utils.dcp_to_torch_save does, without writing a torch.save file
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader(work + "/ckpt"),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        save_file(sd, work + "/model.safetensors", metadata={"format": "pt"})
        marks["convert_s"] = time.perf_counter() - t
        del sd
        t = time.perf_counter()
        fs.put_file(work + "/model.safetensors",
                    spec["dest"].removeprefix("s3://") + "/model.safetensors")
        marks["upload_s"] = time.perf_counter() - t
        return {**marks, "bytes": os.path.getsize(work + "/model.safetensors")}
    try:
        return _measure(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    import s3fs

    fs = s3fs.S3FileSystem(**spec["opts"])
    src = spec["src"].removeprefix("s3://")
    paths = [p for p in fs.find(src) if p.endswith(".distcp")]

    def run() -> dict[str, Any]:
        t = time.perf_counter()
        blobs = fs.cat(paths)  # concurrent GETs, whole objects
        down = time.perf_counter() - t
        data = b"".join(blobs.values())
        del blobs
        t = time.perf_counter()
        _put(spec["dest"], spec["opts"], data)
        up = time.perf_counter() - t
        return {"download_s": down, "upload_s": up, "bytes": len(data)}
    out = _measure(run)
    out["wall_s"] = out["download_s"] + out["upload_s"]  # without the join in between
    return out


def _put(dest: str, opts: dict[str, Any], data: bytes) -> None:
    """One object of ``data`` through our backend's multipart sink and uploader (the
    fastest put this client has: parts in flight, CRC32C instead of SHA-256 signing)."""
    import threading

    from dcp_volumes.backends import CallStats, open_backend
    from dcp_volumes.config import TransferOptions
    from dcp_volumes.saving import SpoolFile, Uploader

    t = TransferOptions()
    backend = open_backend(dest, opts)
    up = Uploader(backend, part_size=t.part_size, max_concurrency=t.max_concurrency,
                  stats=CallStats(), adaptive=t.adaptive_concurrency)
    slots = threading.Semaphore(t.max_concurrency + 1)
    spool = SpoolFile("ceiling.bin", mode="memory", directory="", part_size=t.part_size,
                      buffer_slots=slots)
    up.upload("ceiling.bin", spool.parts, expected_size=len(data))
    spool.write(data)
    spool.close()
    up.wait()


def _child(spec: dict[str, Any]) -> None:
    fn = {"ours": _ours, "today": _today, "ceiling": _ceiling}[spec["contender"]]
    print("RESULT " + json.dumps(fn(spec)), flush=True)


def _run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                         capture_output=True, text=True, env=env, timeout=1200, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{spec['contender']} failed: {out.stderr[-3000:]}")


def _parse_size(text: str) -> int:
    from dcp_volumes.bench.harness import parse_size

    return parse_size(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256MiB,1GiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/export-safetensors.jsonl")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(json.loads(args.child))
        return
    from dcp_volumes.testing.dist import run_ranks
    from dcp_volumes.testing.servers import start_server

    server = start_server("seaweedfs")
    rows: list[dict[str, Any]] = []
    try:
        root = server.create_bucket(f"bench-{uuid.uuid4().hex[:8]}")
        opts = server.storage_options()
        env = {**os.environ, **server.env()}
        fs = __import__("s3fs").S3FileSystem(**opts)
        with open(args.out, "w") as out:
            for size_text in args.sizes.split(","):
                size = _parse_size(size_text)
                src, dest = f"{root}/ckpt-{size_text}", f"{root}/hf-{size_text}"
                run_ranks(2, _save_rank, src, opts, size, timeout=900)
                for rep in range(args.reps):
                    for contender in CONTENDERS:
                        spec = {"contender": contender, "src": src, "dest": dest,
                                "opts": opts, "tmp": tempfile.gettempdir()}
                        row = {"size": size_text, "rep": rep, "contender": contender,
                               **_run_child(spec, env)}
                        fs.rm(dest.removeprefix("s3://"), recursive=True)
                        print(json.dumps(row), flush=True)
                        out.write(json.dumps(row) + "\n")
                        rows.append(row)
                fs.rm(src.removeprefix("s3://"), recursive=True)
            meta = {"command": " ".join(sys.argv), "python": platform.python_version(),
                    "machine": platform.machine(), "cpus": os.cpu_count(),
                    "load_avg": os.getloadavg(), "versions": _versions()}
            out.write(json.dumps({"meta": meta}) + "\n")
    finally:
        server.stop()
    _table(rows)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {n: md.version(n) for n in ("torch", "s3fs", "safetensors", "dcp-volumes")
            if _has(n)}


def _has(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def _table(rows: list[dict[str, Any]]) -> None:
    print("\n| size | contender | time s (median) | peak RSS MiB above base (median) |"
          " × ceiling time | today ÷ ours time | ours ÷ today RSS |")
    print("|---|---|---|---|---|---|---|")
    for size in dict.fromkeys(r["size"] for r in rows):
        med = {c: (statistics.median(r["wall_s"] for r in rows
                                     if r["size"] == size and r["contender"] == c),
                   statistics.median(r["rss_peak_mib"] for r in rows
                                     if r["size"] == size and r["contender"] == c))
               for c in CONTENDERS}
        for c in CONTENDERS:
            t, m = med[c]
            print(f"| {size} | {c} | {t:.2f} | {m:.0f} | {t / med['ceiling'][0]:.2f} | "
                  f"{med['today'][0] / t:.2f} | {m / med['today'][1]:.2f} |")


if __name__ == "__main__":
    main()
