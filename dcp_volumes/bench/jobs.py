"""The measurements a worker runs: save and load, ``async_save``, resharded loads and
rank scaling. Multi-rank jobs run their ``_rank_*`` functions on every rank (gloo on
127.0.0.1) through :func:`dcp_volumes.testing.dist.run_ranks`, which pickles them by name.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any

from dcp_volumes.bench.contenders import last_stats, make_reader, make_writer, parse_contender
from dcp_volumes.bench.measure import RssSampler, Timer, rss
from dcp_volumes.bench.state import (
    MiB,
    TensorSpec,
    build_state,
    check_state,
    layout_for,
    local_bytes,
    state_bytes,
    tiny_state,
)

__all__ = ["job_async", "job_reshard", "job_save_load", "job_scaling"]


def job_save_load(spec: dict[str, Any]) -> dict[str, Any]:
    """Save, then load, the state dict with one contender; timed, RSS-sampled, checked."""
    import torch.distributed.checkpoint as dcp

    contender = spec["contender"]
    url = spec["url"]
    if parse_contender(contender)["family"] == "local":
        url = os.path.join(spec["local_dir"], "ckpt")
        warm = os.path.join(spec["local_dir"], "warmup")
    else:
        warm = spec["url"].rstrip("/") + "-warmup"
    specs = layout_for(spec["size"])
    state = build_state(spec["pool"], specs)
    total = state_bytes(specs)

    # Warm the clients (sessions, connection pools, imports) on a tiny checkpoint.
    dcp.save(tiny_state(), storage_writer=make_writer(contender, warm, spec), no_dist=True)
    dcp.load(tiny_state(), storage_reader=make_reader(contender, warm, spec), no_dist=True)

    writer = make_writer(contender, url, spec)
    gc.collect()
    base = rss()
    with RssSampler() as sampler, Timer() as save:
        dcp.save(state, storage_writer=writer, no_dist=True)
    out: dict[str, Any] = {
        "bytes": total, "save_s": save.wall, "save_cpu_s": save.cpu,
        "save_rss_peak_mib": (sampler.peak - base) / MiB, "rss_base_mib": base / MiB,
        "writer_stats": last_stats(writer),
    }
    del writer
    if spec.get("save_only"):
        return out
    target = build_state(spec["pool"], specs, fill=False)
    reader = make_reader(contender, url, spec)
    gc.collect()
    base = rss()
    with RssSampler() as sampler, Timer() as load:
        dcp.load(target, storage_reader=reader, no_dist=True)
    out.update({
        "load_s": load.wall, "load_cpu_s": load.cpu,
        "load_rss_peak_mib": (sampler.peak - base) / MiB, "reader_stats": last_stats(reader),
        "ok": check_state(spec["pool"], specs, target),
    })
    return out



def job_async(spec: dict[str, Any]) -> dict[str, Any]:
    """``dcp.async_save`` with VolumeWriter as its own stager, next to the copy floors.

    The first async_save allocates the staging buffers (they belong to the process, keyed by
    the state's layout). Then two patterns, interleaved A B B A, each save waited on before
    the next: one writer kept across saves (``checkpoint_id=`` per step, as the Checkpointer
    does) and a fresh writer per step (constructed inside the timed call, as a training loop
    would). Each pattern's blocking time is the mean of its two saves.
    """
    import torch.distributed.checkpoint as dcp

    specs = layout_for(spec["size"])
    state = build_state(spec["pool"], specs)
    tensors = [state[s.name] for s in specs]
    url = spec["url"].rstrip("/")
    writer = make_writer(spec["contender"], url + "/a0", spec)
    with Timer() as first:
        fut: Any = dcp.async_save(state, checkpoint_id=url + "/a0", storage_writer=writer)
    fut.result()
    floors = _copy_floors(tensors)
    gc.collect()

    blocks: dict[str, list[float]] = {"kept": [], "fresh": []}
    dones: dict[str, list[float]] = {"kept": [], "fresh": []}
    fresh_allocations = 0
    for i, pattern in enumerate(("kept", "fresh", "fresh", "kept"), start=1):
        ckpt = f"{url}/a{i}"
        with Timer() as block:
            if pattern == "kept":
                fut = dcp.async_save(state, checkpoint_id=ckpt, storage_writer=writer)
            else:
                fresh = make_writer(spec["contender"], ckpt, spec)
                fut = dcp.async_save(state, storage_writer=fresh)
        t0 = time.perf_counter() - block.wall
        fut.result()
        dones[pattern].append(time.perf_counter() - t0)
        blocks[pattern].append(block.wall)
        if pattern == "fresh":
            fresh_allocations += getattr(getattr(fresh, "_staging", None), "allocations", 0)
            del fresh
    out: dict[str, Any] = {
        "bytes": state_bytes(specs),
        "async_block_s": statistics.fmean(blocks["kept"]),
        "async_fresh_block_s": statistics.fmean(blocks["fresh"]),
        "async_done_s": statistics.fmean(dones["kept"]),
        "async_fresh_done_s": statistics.fmean(dones["fresh"]),
        "async_first_block_s": first.wall,
        **floors,
        "staging_allocations": getattr(getattr(writer, "_staging", None), "allocations", None),
        "fresh_staging_allocations": fresh_allocations,
        "writer_stats": last_stats(writer),
    }
    writer.close()
    if spec.get("torch_default_stager"):
        out.update(_torch_stager(state, url, spec))
    return out


def _copy_floors(tensors: list[Any]) -> dict[str, float]:
    """Copy floors: into preallocated (already touched) buffers, and a fresh clone."""
    import torch

    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors):
        b.copy_(t)
    prealloc, clone = [], []
    with Timer() as tm:
        clones = [t.clone() for t in tensors]
    clone_first = tm.wall  # page-faulting, like torch's DefaultStager on each save
    del clones
    for _ in range(3):
        with Timer() as tm:
            for b, t in zip(bufs, tensors):
                b.copy_(t)
        prealloc.append(tm.wall)
        with Timer() as tm:
            clones = [t.clone() for t in tensors]
        clone.append(tm.wall)
        del clones
    del bufs
    return {"copy_prealloc_s": sorted(prealloc)[1], "copy_clone_s": clone_first,
            "copy_clone_warm_s": sorted(clone)[1]}


def _torch_stager(state: dict[str, Any], url: str, spec: dict[str, Any]) -> dict[str, float]:
    """torch's DefaultStager (a fresh CPU copy per save) in front of FsspecWriter t=8."""
    import torch.distributed.checkpoint as dcp

    fw = make_writer("fsspec-t8", url + "/d0", spec)
    fut: Any = dcp.async_save(state, checkpoint_id=url + "/d0", storage_writer=fw)
    fut.result()
    with Timer() as tblock:
        fut = dcp.async_save(state, checkpoint_id=url + "/d1",
                             storage_writer=make_writer("fsspec-t8", url + "/d1", spec))
    t0 = time.perf_counter() - tblock.wall
    fut.result()
    return {"torch_stager_block_s": tblock.wall,
            "torch_stager_done_s": time.perf_counter() - t0}


# -------------------------------------------------------------------------------------------
# Multi-rank jobs (gloo on 127.0.0.1): functions run on every rank by run_ranks


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _mesh(world: int, layout: str) -> Any:
    if layout != "sharded":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _rank_save(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    layout = spec["layout"]
    mesh = _mesh(world, layout)
    specs = layout_for(spec["size"])
    state = build_state(spec["pool"], specs, layout=layout, world=world, rank=rank, mesh=mesh)
    url = spec["url"].rstrip("/")
    dcp.save(tiny_state(), storage_writer=make_writer(spec["contender"], url + "-warmup", spec))
    writer = make_writer(spec["contender"], url, spec)
    gc.collect()
    base = rss()
    _barrier()
    with RssSampler() as sampler, Timer() as save:
        dcp.save(state, storage_writer=writer)
        _barrier()
    out: dict[str, Any] = {"rank": rank, "save_s": save.wall, "save_cpu_s": save.cpu,
                           "save_rss_peak_mib": (sampler.peak - base) / MiB,
                           "writer_stats": last_stats(writer)}
    if spec.get("load_same"):
        out.update(_rank_load_into(rank, world, spec, url, layout, mesh, specs))
    return out


def _rank_load(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    layout = spec["layout"]
    mesh = _mesh(world, layout)
    return {"rank": rank, **_rank_load_into(rank, world, spec, spec["url"].rstrip("/"), layout,
                                            mesh, layout_for(spec["size"]))}


def _rank_load_into(rank: int, world: int, spec: dict[str, Any], url: str, layout: str,
                    mesh: Any, specs: list[TensorSpec]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    target = build_state(spec["pool"], specs, layout=layout, world=world, rank=rank, mesh=mesh,
                         fill=False)
    reader = make_reader(spec["contender"], url, spec)
    gc.collect()
    _barrier()
    with Timer() as load:
        dcp.load(target, storage_reader=reader)
        _barrier()
    return {"load_s": load.wall, "load_cpu_s": load.cpu, "reader_stats": last_stats(reader),
            "logical_bytes_needed": local_bytes(target),
            "ok": check_state(spec["pool"], specs, target, layout=layout, world=world, rank=rank)}


def _rank_scaling(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for layout in spec["layouts"]:
        url = f"{spec['url'].rstrip('/')}/{layout}"
        out[layout] = _rank_save(rank, world, {**spec, "layout": layout, "url": url,
                                               "load_same": True})
        gc.collect()
    return out


def job_scaling(spec: dict[str, Any]) -> dict[str, Any]:
    """Save and load the same total size with ``world`` ranks, for each layout in
    ``layouts`` (sharded DTensors, replicated plain tensors), in one set of rank processes."""
    from dcp_volumes.testing.dist import run_ranks

    world = int(spec["world"])
    per_rank = run_ranks(world, _rank_scaling, spec, timeout=spec["timeout"])
    by_layout = {}
    for layout in spec["layouts"]:
        ranks = [r[layout] for r in per_rank]
        r0 = ranks[0]
        by_layout[layout] = {
            "bytes": state_bytes(layout_for(spec["size"])), "world": world,
            "save_s": r0["save_s"], "load_s": r0["load_s"],
            "save_rss_peak_mib": max(r["save_rss_peak_mib"] for r in ranks),
            "bytes_fetched": sum((r["reader_stats"] or {}).get("bytes_fetched", 0)
                                 for r in ranks),
            "ok": all(r["ok"] for r in ranks), "ranks": ranks,
        }
    return {"by_layout": by_layout, "ok": all(v["ok"] for v in by_layout.values())}


def job_reshard(spec: dict[str, Any]) -> dict[str, Any]:
    """Save sharded on ``save_world`` ranks, load on each of ``load_worlds``."""
    from dcp_volumes.testing.dist import run_ranks

    base = {**spec, "layout": "sharded"}
    saved = run_ranks(int(spec["save_world"]), _rank_save, base, timeout=spec["timeout"])
    out: dict[str, Any] = {"bytes": state_bytes(layout_for(spec["size"])),
                           "save_s": saved[0]["save_s"], "loads": {}}
    ok = True
    for lw in spec["load_worlds"]:
        ranks = run_ranks(int(lw), _rank_load, base, timeout=spec["timeout"])
        needed = sum((r["reader_stats"] or {}).get("bytes_needed", 0) for r in ranks)
        fetched = sum((r["reader_stats"] or {}).get("bytes_fetched", 0) for r in ranks)
        logical = sum(r["logical_bytes_needed"] for r in ranks)
        ok = ok and all(r["ok"] for r in ranks)
        out["loads"][str(lw)] = {
            "load_s": ranks[0]["load_s"], "bytes_needed": needed, "bytes_fetched": fetched,
            "logical_bytes_needed": logical, "ranges": sum(
                (r["reader_stats"] or {}).get("ranges", 0) for r in ranks),
            "per_rank": [{k: r[k] for k in ("load_s", "logical_bytes_needed")}
                         | {"bytes_fetched": (r["reader_stats"] or {}).get("bytes_fetched", 0),
                            "bytes_needed": (r["reader_stats"] or {}).get("bytes_needed", 0)}
                         for r in ranks],
        }
    out["ok"] = ok
    return out

