"""Rank 0's cost at scale, without real ranks: synthetic save results for N items.

Builds a DCP ``Metadata`` and every rank's ``WriteResult``s directly (``--items-per-rank``
small tensors per rank, one shard file per rank, files created sparse at their size), then
times, on a local directory (file://):

- ``VolumeWriter.finish(metadata, results)`` (manifest, ``.metadata`` pickle, the presence
  check before commit, the commit) against torch's ``FileSystemWriter.finish`` on the same
  inputs;
- ``VolumeReader.read_metadata()`` (``.metadata`` + manifest) against
  ``FileSystemReader.read_metadata()``;
- with ``--plan-ranks R``: the plan phase of ``dcp.save`` (start to ``write_data``) on R
  gloo ranks, save after save, with and without ``enable_plan_caching``;
- with ``--catalog N``: ``list_checkpoints`` / ``latest`` / ``gc(dry_run=True)`` over a root
  holding N tiny checkpoints (one real save copied N times).

Usage::

    .venv/bin/python benchmarks/coordinator_scale.py --items 1000 10000 100000 1000000 \\
        --catalog 1000
    .venv/bin/python benchmarks/coordinator_scale.py --items --plan-ranks 2 --plan-tensors 2000
"""

from __future__ import annotations

import argparse
import functools
import gc as pygc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes import VolumeReader, VolumeWriter, _layout
from dcp_volumes._manifest import CheckedWriteResult

ITEM_ELEMS = 256  # float32: 1 KiB of data per item (+ torch.save framing, ignored here)


def synthetic(items: int, per_rank: int, checked: bool
              ) -> tuple[Metadata, list[list[WriteResult]], dict[str, int]]:
    """Metadata + per-rank results for ``items`` one-chunk tensors; and each file's size."""
    ranks = max(1, items // per_rank)
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([ITEM_ELEMS])
    length = ITEM_ELEMS * 4 + 700
    save_id = "00000000-000000000000"
    sdm: dict[str, Any] = {}
    results: list[list[WriteResult]] = []
    files: dict[str, int] = {}
    for r in range(ranks):
        name = _layout.shard_name(r, 0, save_id) if checked else f"__{r}_0.distcp"
        rank_results: list[WriteResult] = []
        for j in range(per_rank):
            fqn = f"layers.{r}.p{j}"
            sdm[fqn] = TensorStorageMetadata(props, size,
                                             [ChunkStorageMetadata(torch.Size([0]), size)])
            index = MetadataIndex(fqn, torch.Size([0]), 0)
            info = _StorageInfo(name, j * length, length)
            if checked:
                rank_results.append(CheckedWriteResult(index=index, size_in_bytes=length,
                                                        storage_data=info, crc32c=j))
            else:
                rank_results.append(WriteResult(index=index, size_in_bytes=length,
                                                storage_data=info))
        files[name] = per_rank * length
        results.append(rank_results)
    return Metadata(state_dict_metadata=sdm), results, files


def _sparse_files(directory: str, files: dict[str, int]) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, size in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.truncate(size)


def _timed(fn: Any) -> float:
    pygc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _timed_peak(fn: Any) -> tuple[float, int]:
    """Seconds ``fn()`` took and its peak RSS above the RSS it started at (bytes): the
    kernel's high-water mark is reset first (``/proc/self/clear_refs``, Linux >= 4.0)."""
    pygc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    return took, (_status_kib("VmHWM") - before) * 1024


def coordinator_row(items: int, per_rank: int, tmp: str) -> dict[str, Any]:
    row: dict[str, Any] = {"items": items, "ranks": max(1, items // per_rank)}
    # ours
    md, results, files = synthetic(items, per_rank, checked=True)
    ours = os.path.join(tmp, f"ours-{items}")
    _sparse_files(ours, files)
    writer = VolumeWriter(ours)
    writer._save_id = "00000000-000000000000"
    row["vol_finish_s"], peak = _timed_peak(functools.partial(writer.finish, md, results))
    row["vol_finish_peak_bytes_per_item"] = round(peak / items)
    names = os.listdir(ours)
    meta_b = os.path.getsize(os.path.join(ours, ".metadata"))
    man_b = sum(os.path.getsize(os.path.join(ours, n)) for n in names
                if n.startswith(_layout.MANIFEST_PREFIX))
    row["vol_bytes_per_item"] = round((meta_b + man_b) / items, 1)
    row["vol_manifest_bytes_per_item"] = round(man_b / items, 1)
    del md, results
    reader = VolumeReader(ours)
    row["vol_read_metadata_s"], peak = _timed_peak(reader.read_metadata)
    row["vol_read_peak_bytes_per_item"] = round(peak / items)
    del reader
    shutil.rmtree(ours)
    # torch
    md, results, files = synthetic(items, per_rank, checked=False)
    theirs = os.path.join(tmp, f"torch-{items}")
    _sparse_files(theirs, files)
    fs_writer = FileSystemWriter(theirs)
    row["torch_finish_s"], peak = _timed_peak(functools.partial(fs_writer.finish, md, results))
    row["torch_finish_peak_bytes_per_item"] = round(peak / items)
    row["torch_bytes_per_item"] = round(
        os.path.getsize(os.path.join(theirs, ".metadata")) / items, 1)
    del md, results
    fs_reader = FileSystemReader(theirs)
    row["torch_read_metadata_s"], peak = _timed_peak(fs_reader.read_metadata)
    row["torch_read_peak_bytes_per_item"] = round(peak / items)
    shutil.rmtree(theirs)
    row["finish_ratio"] = round(row["vol_finish_s"] / row["torch_finish_s"], 2)
    row["read_ratio"] = round(row["vol_read_metadata_s"] / row["torch_read_metadata_s"], 2)
    return row


def catalog_row(n: int, tmp: str, files: int = 1, store: str = "local") -> dict[str, Any]:
    """``list_checkpoints`` / ``latest`` / ``gc(dry_run=True)`` over ``n`` checkpoints of
    ``files`` shard files each (``files + 2`` objects with ``.metadata`` and the manifest),
    on local files or (``store="seaweedfs"``) a local SeaweedFS S3 server, where every call
    pages through LIST answers of 1,000 keys. One real save, copied ``n - 1`` times
    (server-side copies on S3)."""
    import fsspec

    from dcp_volumes import SpoolOptions
    from dcp_volumes.catalog import gc, latest, list_checkpoints

    server = None
    opts: dict[str, Any] = {}
    if store == "seaweedfs":
        from dcp_volumes.testing.servers import start_server

        server = start_server("seaweedfs")
        opts = server.storage_options()
        root = server.create_bucket(f"catalog-{os.getpid()}") + "/run"
    else:
        root = os.path.join(tmp, "run")
    try:
        first = f"{root}/step-00000000"
        state = {f"w{i}": torch.arange(16.0) + i for i in range(files)}
        dcp.save({**state, "step": 0},
                 storage_writer=VolumeWriter(first, storage_options=opts,
                                             spool=SpoolOptions(files_per_rank=files)),
                 no_dist=True)
        fs, first_path = fsspec.core.url_to_fs(first, **opts)
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(first_path, detail=False)]
        start = time.perf_counter()
        if server is None:
            for i in range(1, n):
                shutil.copytree(first, os.path.join(root, f"step-{i:08d}"))
        else:
            base = first_path.rsplit("/", 1)[0]
            for lo in range(1, n, 50):  # server-side copies, 50 checkpoints per batch
                steps = range(lo, min(n, lo + 50))
                src = [f"{first_path}/{name}" for _ in steps for name in names]
                dst = [f"{base}/step-{i:08d}/{name}" for i in steps for name in names]
                fs.copy(src, dst)
        row: dict[str, Any] = {"store": store, "checkpoints": n, "objects": n * len(names),
                               "fabricate_s": round(time.perf_counter() - start, 2)}
        row["ls_s"] = _timed(lambda: list_checkpoints(root, storage_options=opts))
        row["ls_check0_s"] = _timed(lambda: list_checkpoints(root, storage_options=opts,
                                                              check=0))
        row["latest_s"] = _timed(lambda: latest(root, storage_options=opts))
        report = None

        def _gc() -> None:
            nonlocal report
            report = gc(root, storage_options=opts, dry_run=True, older_than_s=0.0)

        row["gc_dry_run_s"] = _timed(_gc)
        assert report is not None and not report.leftovers, "a copied checkpoint read as leftovers"
        row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    finally:
        if server is not None:
            server.stop()
        else:
            shutil.rmtree(root, ignore_errors=True)
    return row


class _TimedWriter(VolumeWriter):
    """Records when ``write_data`` starts: everything before it is the plan phase."""

    plan_end = 0.0

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.plan_end = time.perf_counter()
        return super().write_data(plan, planner)


def plan_phase_on_ranks(rank: int, world_size: int, root: str, tensors: int, saves: int,
                        caching: bool) -> list[float]:
    """Each save's plan phase (``dcp.save`` start to ``write_data``) on this rank."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {f"layers.{i}.w": torch.full((16,), float(i)) for i in range(tensors)}
    out = []
    for step in range(saves):
        writer = _TimedWriter(f"{root}/{'c' if caching else 'u'}-{step}")
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer,
                 planner=DefaultSavePlanner(enable_plan_caching=caching))
        out.append(writer.plan_end - start)
    return out


def plan_rows(ranks: int, tensors: int, saves: int, tmp: str) -> list[dict[str, Any]]:
    from dcp_volumes.testing.dist import run_ranks

    rows = []
    for caching in (False, True):
        per_rank = run_ranks(ranks, plan_phase_on_ranks, os.path.join(tmp, "plan"), tensors,
                             saves, caching, timeout=900)
        worst = [max(r[i] for r in per_rank) for i in range(saves)]
        rows.append({"plan_caching": caching, "ranks": ranks, "tensors": tensors,
                     "plan_s_per_save": [round(t, 3) for t in worst]})
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    header = ("| items | ranks | finish: ours / torch (s) | ratio | read_metadata: ours / torch "
              "(s) | ratio | bytes/item: ours (manifest) / torch | peak RSS bytes/item, finish: ours / "
              "torch | read: ours / torch |")
    out = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['items']:,} | {r['ranks']:,} | {r['vol_finish_s']:.3f} / "
            f"{r['torch_finish_s']:.3f} | {r['finish_ratio']} | {r['vol_read_metadata_s']:.3f} / "
            f"{r['torch_read_metadata_s']:.3f} | {r['read_ratio']} | {r['vol_bytes_per_item']} "
            f"({r['vol_manifest_bytes_per_item']}) / {r['torch_bytes_per_item']} | "
            f"{r['vol_finish_peak_bytes_per_item']:,} / {r['torch_finish_peak_bytes_per_item']:,} | "
            f"{r['vol_read_peak_bytes_per_item']:,} / {r['torch_read_peak_bytes_per_item']:,} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, nargs="*", default=[1000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--items-per-rank", type=int, default=250)
    ap.add_argument("--catalog", type=int, default=0, help="checkpoints for the catalog timing")
    ap.add_argument("--catalog-files", type=int, default=1,
                    help="shard files per checkpoint of the catalog timing")
    ap.add_argument("--catalog-store", choices=["local", "seaweedfs"], nargs="+",
                    default=["local"])
    ap.add_argument("--plan-ranks", type=int, default=0,
                    help="measure the plan phase with/without plan caching on this many ranks")
    ap.add_argument("--plan-tensors", type=int, default=2000)
    ap.add_argument("--plan-saves", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="coord-scale-", dir=args.dir)
    print(json.dumps({"command": " ".join(sys.argv), "torch": torch.__version__,
                      "cpus": os.cpu_count()}), flush=True)
    rows = []
    try:
        for items in args.items:
            row = coordinator_row(items, args.items_per_rank, tmp)
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
        if rows:
            print(_markdown(rows), flush=True)
        if args.catalog:
            for store in args.catalog_store:
                row = catalog_row(args.catalog, tmp, args.catalog_files, store)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
        if args.plan_ranks:
            for row in plan_rows(args.plan_ranks, args.plan_tensors, args.plan_saves, tmp):
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
