"""Measurement side of ``dcp-volumes bench``: runs in a fresh process per measurement.

``python -m dcp_volumes._bench_worker SPEC.json OUT.json`` runs the jobs listed in the spec
file and writes one result dict per job. The orchestrator (:mod:`dcp_volumes.bench`) starts
one worker per measurement so that peak RSS, allocator state and warm connections of one
contender never leak into another's figures. Secrets never appear in a spec: credentials
reach the clients through the environment the orchestrator gives the worker.

Every contender saves the same state dict (tensors filled from one random "pool" file, so
that each process can rebuild exactly the same bytes and check what it loads), warms its
clients with a tiny save and load first, and then is timed on one ``dcp.save`` and one
``dcp.load``.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20

# -------------------------------------------------------------------------------------------
# The state dict: a model-like layout whose bytes come from the pool file


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the benchmark state dict and where its bytes live in the pool file."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16"
    offset: int

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize


def layout_for(total: int) -> list[TensorSpec]:
    """Layers of (weight [R, 1024] f32, bias [1024] f32, norm [1024] bf16) adding up to
    about ``total`` bytes. Row counts are multiples of 12 so 1, 2, 3 and 4 ranks shard evenly.
    """
    cols = 1024
    layer = min(32 * MiB, max(256 * 1024, total // 8))
    rows = max(12, (layer // (cols * 4)) // 12 * 12)
    per_layer = rows * cols * 4 + cols * 4 + cols * 2
    nlayers = max(1, total // per_layer)
    specs: list[TensorSpec] = []
    offset = 0
    for i in range(nlayers):
        for name, shape, dtype in ((f"layers.{i}.weight", (rows, cols), "float32"),
                                   (f"layers.{i}.bias", (cols,), "float32"),
                                   (f"layers.{i}.norm", (cols,), "bfloat16")):
            spec = TensorSpec(name, shape, dtype, offset)
            specs.append(spec)
            offset += spec.nbytes
    return specs


def state_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def write_pool(path: str, nbytes: int, seed: int = 0) -> None:
    """Random bytes (incompressible, so no store can shortcut them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, 64 * MiB)
            f.write(rng.bytes(n))
            left -= n


def _read_into(fd: int, buf: Any, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"pool file too short at {offset + done}")
        done += n


def _chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of ``rank`` under DTensor Shard(0) (torch.chunk semantics)."""
    size = -(-n // world)
    start = min(n, rank * size)
    return start, min(n, start + size)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _local_tensor(fd: int, spec: TensorSpec, world: int, rank: int, *, fill: bool) -> Any:
    import torch

    r0, r1 = _chunk(spec.shape[0], world, rank)
    shape = (r1 - r0, *spec.shape[1:])
    t = torch.empty(shape, dtype=_torch_dtype(spec.dtype))
    raw = t.view(-1).view(torch.uint8)
    if fill:
        if raw.numel():
            _read_into(fd, raw.numpy(), spec.offset + r0 * spec.row_bytes)
    else:
        raw.fill_(0)
    return t


def build_state(pool: str, specs: list[TensorSpec], *, layout: str = "plain", world: int = 1,
                rank: int = 0, mesh: Any = None, fill: bool = True) -> dict[str, Any]:
    """The benchmark state dict (``fill=False``: a zeroed target of the same shape).

    ``layout``: ``plain`` (one process), ``replicated`` (every rank holds everything) or
    ``sharded`` (DTensors, Shard(0) over ``mesh``).
    """
    import torch

    state: dict[str, Any] = {}
    fd = os.open(pool, os.O_RDONLY)
    try:
        for spec in specs:
            if layout == "sharded":
                from torch.distributed.tensor import DTensor, Shard

                local = _local_tensor(fd, spec, world, rank, fill=fill)
                full = torch.Size(spec.shape)
                stride = tuple(math.prod(spec.shape[i + 1:]) for i in range(len(spec.shape)))
                state[spec.name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                      shape=full, stride=stride)
            else:
                state[spec.name] = _local_tensor(fd, spec, 1, 0, fill=fill)
    finally:
        os.close(fd)
    state["step"] = 1000 if fill else 0
    state["meta"] = {"lr": 1e-4, "name": "dcp-volumes-bench"} if fill else {}
    return state


def check_state(pool: str, specs: list[TensorSpec], state: dict[str, Any], *,
                layout: str = "plain", world: int = 1, rank: int = 0) -> bool:
    """Whether every tensor in ``state`` holds exactly the pool's bytes."""
    import torch

    fd = os.open(pool, os.O_RDONLY)
    try:
        for spec in specs:
            t = state[spec.name]
            if layout == "sharded":
                t = t.to_local()
                want = _local_tensor(fd, spec, world, rank, fill=True)
            else:
                want = _local_tensor(fd, spec, 1, 0, fill=True)
            if not torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                return False
    finally:
        os.close(fd)
    return state.get("step") == 1000


def local_bytes(state: dict[str, Any]) -> int:
    """Tensor bytes this rank holds (what a load into ``state`` logically needs)."""
    n = 0
    for v in state.values():
        if hasattr(v, "to_local"):
            v = v.to_local()
        if hasattr(v, "nbytes") and hasattr(v, "dtype"):
            n += int(v.nbytes)
    return n


def tiny_state() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(256, 1024, generator=g), "step": 1}


# -------------------------------------------------------------------------------------------
# Measuring helpers


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class RssSampler:
    """Peak RSS of this process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._proc.memory_info().rss)
            except Exception:  # noqa: BLE001, S110 — a missed sample is fine
                pass
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:  # noqa: PYI034
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Timer:
    def __enter__(self) -> Timer:  # noqa: PYI034
        self.cpu0 = cpu_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = cpu_s() - self.cpu0


# -------------------------------------------------------------------------------------------
# Contenders: writers and readers


def parse_contender(name: str) -> dict[str, Any]:
    """``vol-disk`` → {family: vol, spool: disk, concurrency: None} (the defaults: adaptive);
    ``vol-disk-c8`` → concurrency fixed at 8; ``fsspec-t1``; ``s3tc-t8``; ``local-fs``;
    ``raw-obstore`` / ``raw-s3fs`` / ``raw-boto3``, optionally ``-cN`` requests in flight."""
    parts = name.split("-")
    if parts[0] == "vol" and len(parts) in (2, 3) and parts[1] in ("disk", "memory"):
        conc = _concurrency_suffix(parts[2]) if len(parts) == 3 else None
        return {"family": "vol", "spool": parts[1], "concurrency": conc}
    if parts[0] in ("fsspec", "s3tc") and len(parts) == 2 and parts[1].startswith("t"):
        return {"family": parts[0], "threads": int(parts[1][1:])}
    if name == "local-fs":
        return {"family": "local"}
    if parts[0] == "raw" and len(parts) in (2, 3) and parts[1] in ("obstore", "s3fs", "boto3",
                                                                   "fsspec"):
        conc = _concurrency_suffix(parts[2]) if len(parts) == 3 else None
        return {"family": "raw", "client": parts[1], "concurrency": conc}
    raise ValueError(f"unknown contender {name!r}")


def _concurrency_suffix(text: str) -> int:
    if not (text.startswith("c") and text[1:].isdigit() and int(text[1:]) > 0):
        raise ValueError(f"contender suffix {text!r}: use cN, e.g. c8")
    return int(text[1:])


def _vol_transfer(c: dict[str, Any], spec: dict[str, Any]) -> Any:
    from dcp_volumes import TransferOptions

    if c["concurrency"] is None:  # the defaults: adaptive up to the default maximum
        return TransferOptions(part_size=spec["part_size"])
    return TransferOptions(part_size=spec["part_size"], max_concurrency=c["concurrency"],
                           adaptive_concurrency=False)


def make_writer(contender: str, url: str, spec: dict[str, Any]) -> Any:
    c = parse_contender(contender)
    opts = dict(spec.get("storage_options") or {})
    if c["family"] == "vol":
        from dcp_volumes import SpoolOptions, VolumeWriter

        return VolumeWriter(
            url, storage_options=opts,
            spool=SpoolOptions(mode=c["spool"], directory=spec.get("spool_dir")),
            transfer=_vol_transfer(c, spec),
        )
    if c["family"] == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url, sync_files=False, thread_count=c["threads"], **opts)
    if c["family"] == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(region=_region(), path=url, thread_count=c["threads"],
                               s3client_config=S3ClientConfig(force_path_style=True))
    if c["family"] == "local":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(url)
    raise ValueError(f"{contender} has no writer")


def make_reader(contender: str, url: str, spec: dict[str, Any]) -> Any:
    c = parse_contender(contender)
    opts = dict(spec.get("storage_options") or {})
    if c["family"] == "vol":
        from dcp_volumes import VolumeReader

        return VolumeReader(url, storage_options=opts, transfer=_vol_transfer(c, spec))
    if c["family"] == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url, **opts)
    if c["family"] == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        return S3StorageReader(region=_region(), path=url,
                               s3client_config=S3ClientConfig(force_path_style=True))
    if c["family"] == "local":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(url)
    raise ValueError(f"{contender} has no reader")


def _region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def _stats(obj: Any) -> dict[str, Any] | None:
    st = getattr(obj, "last_stats", None)
    return st.as_dict() if st is not None else None


# -------------------------------------------------------------------------------------------
# Jobs (one process)


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
        "writer_stats": _stats(writer),
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
        "load_rss_peak_mib": (sampler.peak - base) / MiB, "reader_stats": _stats(reader),
        "ok": check_state(spec["pool"], specs, target),
    })
    return out


def job_raw(spec: dict[str, Any]) -> dict[str, Any]:
    """Upload, then download, the same bytes as plain objects with a raw client.

    The payload is split into ``files`` objects (like the writers' shard files), uploaded
    concurrently with ``concurrency`` requests in flight in total, in ``part_size`` parts.
    """
    parsed = parse_contender(spec["contender"])
    client = parsed["client"]
    size = state_bytes(layout_for(spec["size"]))
    payload = bytearray(size)
    fd = os.open(spec["pool"], os.O_RDONLY)
    try:
        _read_into(fd, payload, 0)
    finally:
        os.close(fd)
    files = max(1, int(spec.get("files", 2)))
    conc = int(parsed["concurrency"] or spec.get("concurrency", 8))
    part = int(spec["part_size"])
    bounds = [(i * size // files, (i + 1) * size // files) for i in range(files)]
    # botocore accepts bytes, not memoryviews: prepare the bodies before the clock starts.
    bodies = [bytes(memoryview(payload)[a:b]) for a, b in bounds]
    del payload
    url = spec["url"].rstrip("/")
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    keys = [f"{prefix}/raw-{i}" for i in range(files)]
    per_file = max(1, conc // files)
    run_up, run_down = _raw_client(client, spec, bucket, part, per_file, conc)
    # Warm-up: one small object up and down.
    warm_key = f"{prefix}/raw-warmup"
    run_up([warm_key], [bodies[0][:MiB]])
    run_down([warm_key], [MiB])
    gc.collect()
    base = rss()
    with RssSampler() as sampler, Timer() as up:
        run_up(keys, bodies)
    out: dict[str, Any] = {"bytes": size, "save_s": up.wall, "save_cpu_s": up.cpu,
                           "save_rss_peak_mib": (sampler.peak - base) / MiB,
                           "concurrency": conc, "files": files}
    with Timer() as down:
        got = run_down(keys, [b - a for a, b in bounds])
    out.update({"load_s": down.wall, "load_cpu_s": down.cpu,
                "ok": all(bytes(g[:4096]) == bytes(b[:4096]) and len(g) == len(b)
                          for g, b in zip(got, bodies))})
    return out


def _raw_client(client: str, spec: dict[str, Any], bucket: str, part: int, per_file: int,
                conc: int) -> tuple[Any, Any]:
    endpoint = (spec.get("storage_options") or {}).get("endpoint_url")

    def ranges(n: int) -> list[tuple[int, int]]:
        return [(o, min(n, o + part)) for o in range(0, n, part)]

    if client == "obstore":
        import concurrent.futures

        import obstore
        from obstore.store import S3Store

        kwargs: dict[str, Any] = {"client_options": {"allow_http": True, "timeout": "300s"},
                                  "virtual_hosted_style_request": False}
        if endpoint:
            kwargs["endpoint"] = endpoint
        store = S3Store(bucket, **kwargs)
        # obstore's sync calls release the GIL and run on its own Tokio runtime; they were
        # much faster here than its asyncio bindings driven by asyncio.run.

        def _up(keys: list[str], bodies: list[Any]) -> None:
            with concurrent.futures.ThreadPoolExecutor(len(keys)) as ex:
                list(ex.map(lambda kb: obstore.put(store, kb[0], kb[1], chunk_size=part,
                                                   max_concurrency=per_file),
                            zip(keys, bodies)))

        def _down(keys: list[str], sizes: list[int]) -> list[Any]:
            # Exactly ``conc`` ranged GETs in flight: one per thread (get_range drops the GIL).
            jobs = [(i, k, a, b) for i, (k, n) in enumerate(zip(keys, sizes))
                    for a, b in ranges(n)]
            with concurrent.futures.ThreadPoolExecutor(conc) as ex:
                got = list(ex.map(lambda j: obstore.get_range(store, j[1], start=j[2], end=j[3]),
                                  jobs))
            return [b"".join(bytes(c) for (i, *_), c in zip(jobs, got) if i == f)
                    for f in range(len(keys))]

        return _up, _down

    if client in ("s3fs", "fsspec"):
        import fsspec

        protocol = spec["url"].split("://", 1)[0]
        fs = fsspec.filesystem(protocol, asynchronous=False, **(spec.get("storage_options") or {}))
        from fsspec.asyn import sync

        async def _aup(keys: list[str], bodies: list[Any]) -> None:
            if protocol == "s3":
                await asyncio.gather(*(fs._pipe_file(f"{bucket}/{k}", b, chunksize=part,
                                                     max_concurrency=per_file)
                                       for k, b in zip(keys, bodies)))
            else:
                await asyncio.gather(*(fs._pipe_file(f"{bucket}/{k}", bytes(b))
                                       for k, b in zip(keys, bodies)))

        async def _adown(keys: list[str], sizes: list[int]) -> list[Any]:
            sem = asyncio.Semaphore(conc)

            async def one(k: str, a: int, b: int) -> bytes:
                async with sem:
                    return await fs._cat_file(f"{bucket}/{k}", start=a, end=b)  # type: ignore[no-any-return]

            chunks = await asyncio.gather(*(asyncio.gather(*(one(k, a, b) for a, b in ranges(n)))
                                            for k, n in zip(keys, sizes)))
            return [b"".join(cs) for cs in chunks]

        return (lambda k, b: sync(fs.loop, _aup, k, b)), (lambda k, s: sync(fs.loop, _adown, k, s))

    if client == "boto3":
        import concurrent.futures

        import boto3
        from boto3.s3.transfer import TransferConfig

        s3 = boto3.client("s3", endpoint_url=endpoint) if endpoint else boto3.client("s3")
        cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                             max_concurrency=per_file, use_threads=True)

        def _up(keys: list[str], bodies: list[Any]) -> None:
            with concurrent.futures.ThreadPoolExecutor(len(keys)) as ex:
                list(ex.map(lambda kb: s3.upload_fileobj(io.BytesIO(kb[1]), bucket, kb[0],
                                                         Config=cfg), zip(keys, bodies)))

        def _down(keys: list[str], sizes: list[int]) -> list[Any]:
            def one(k: str) -> bytes:
                buf = io.BytesIO()
                s3.download_fileobj(bucket, k, buf, Config=cfg)
                return buf.getvalue()

            with concurrent.futures.ThreadPoolExecutor(len(keys)) as ex:
                return list(ex.map(one, keys))

        return _up, _down
    raise ValueError(f"unknown raw client {client!r}")


def job_async(spec: dict[str, Any]) -> dict[str, Any]:
    """``dcp.async_save`` with VolumeWriter as its own stager, next to the copy floors.

    The first async_save allocates the staging buffers; the measured one is the second, on
    the same writer object (buffers reused), after the first finished uploading.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    specs = layout_for(spec["size"])
    state = build_state(spec["pool"], specs)
    tensors = [state[s.name] for s in specs]
    url = spec["url"].rstrip("/")
    writer = make_writer(spec["contender"], url + "/a0", spec)
    with Timer() as first:
        fut: Any = dcp.async_save(state, checkpoint_id=url + "/a0", storage_writer=writer)
    fut.result()

    # Copy floors: into preallocated (already touched) buffers, and a fresh clone.
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
    gc.collect()

    with Timer() as block:
        fut = dcp.async_save(state, checkpoint_id=url + "/a1", storage_writer=writer)
    t0 = time.perf_counter() - block.wall
    fut.result()
    done = time.perf_counter() - t0
    out: dict[str, Any] = {
        "bytes": state_bytes(specs),
        "async_block_s": block.wall, "async_done_s": done, "async_first_block_s": first.wall,
        "copy_prealloc_s": sorted(prealloc)[1], "copy_clone_s": clone_first,
        "copy_clone_warm_s": sorted(clone)[1],
        "staging_allocations": getattr(getattr(writer, "_staging", None), "allocations", None),
        "writer_stats": _stats(writer),
    }
    writer.close()
    if spec.get("torch_default_stager"):
        # torch's DefaultStager (a fresh CPU copy per save) in front of FsspecWriter t=8.
        fw = make_writer("fsspec-t8", url + "/d0", spec)
        fut = dcp.async_save(state, checkpoint_id=url + "/d0", storage_writer=fw)
        fut.result()
        with Timer() as tblock:
            fut = dcp.async_save(state, checkpoint_id=url + "/d1",
                                 storage_writer=make_writer("fsspec-t8", url + "/d1", spec))
        t0 = time.perf_counter() - tblock.wall
        fut.result()
        out["torch_stager_block_s"] = tblock.wall
        out["torch_stager_done_s"] = time.perf_counter() - t0
    return out


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
                           "writer_stats": _stats(writer)}
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
    return {"load_s": load.wall, "load_cpu_s": load.cpu, "reader_stats": _stats(reader),
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


JOBS = {"save_load": job_save_load, "raw": job_raw, "async": job_async,
        "scaling": job_scaling, "reshard": job_reshard}


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    local_dir = None
    try:
        if spec["kind"] == "save_load" and parse_contender(spec["contender"])["family"] == "local":
            local_dir = tempfile.mkdtemp(prefix="dcpv-bench-local-", dir=spec.get("spool_dir"))
            spec = {**spec, "local_dir": local_dir}
        return {"result": JOBS[spec["kind"]](spec)}
    except Exception as exc:  # noqa: BLE001 — reported, the run goes on
        tb = traceback.format_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-4000:]}
    finally:
        if local_dir is not None:
            shutil.rmtree(local_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m dcp_volumes._bench_worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        specs = json.load(f)
    results = []
    for spec in specs:
        results.append(run_job(spec))
        # Write after each job so a timeout keeps what finished.
        tmp = argv[1] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    # Run through the importable module so run_ranks pickles its functions by their real name.
    from dcp_volumes._bench_worker import main as _main

    raise SystemExit(_main())
