"""Raw-client contenders (``raw-obstore``, ``raw-s3fs``, ``raw-boto3``): the same bytes as
plain objects, no checkpoint format. The fastest of them is the *raw ceiling*."""

from __future__ import annotations

import asyncio
import gc
import io
import os
from collections.abc import Callable
from typing import Any

from dcp_volumes.bench.contenders import parse_contender
from dcp_volumes.bench.measure import RssSampler, Timer, rss
from dcp_volumes.bench.state import MiB, layout_for, read_into, state_bytes

__all__ = ["job_raw"]

Upload = Callable[[list[str], list[Any]], None]
Download = Callable[[list[str], list[int]], list[Any]]


def job_raw(spec: dict[str, Any]) -> dict[str, Any]:
    """Upload, then download, the same bytes as plain objects with a raw client.

    The payload is split into ``files`` objects (like the writers' shard files), uploaded
    concurrently with ``concurrency`` requests in flight in total, in ``part_size`` parts.
    """
    parsed = parse_contender(spec["contender"])
    client = parsed["client"]
    size = state_bytes(layout_for(spec["size"]))
    files = max(1, int(spec.get("files", 2)))
    conc = int(parsed["concurrency"] or spec.get("concurrency", 8))
    part = int(spec["part_size"])
    bounds = [(i * size // files, (i + 1) * size // files) for i in range(files)]
    bodies = _bodies(spec["pool"], size, bounds)
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


def _bodies(pool: str, size: int, bounds: list[tuple[int, int]]) -> list[bytes]:
    payload = bytearray(size)
    fd = os.open(pool, os.O_RDONLY)
    try:
        read_into(fd, payload, 0)
    finally:
        os.close(fd)
    # botocore accepts bytes, not memoryviews: prepare the bodies before the clock starts.
    return [bytes(memoryview(payload)[a:b]) for a, b in bounds]


def _ranges(n: int, part: int) -> list[tuple[int, int]]:
    return [(o, min(n, o + part)) for o in range(0, n, part)]


def _raw_client(client: str, spec: dict[str, Any], bucket: str, part: int, per_file: int,
                conc: int) -> tuple[Upload, Download]:
    if client == "obstore":
        return _obstore_client(spec, bucket, part, per_file, conc)
    if client in ("s3fs", "fsspec"):
        return _fsspec_client(spec, bucket, part, per_file, conc)
    if client == "boto3":
        return _boto3_client(spec, bucket, part, per_file)
    raise ValueError(f"unknown raw client {client!r}")


def _endpoint(spec: dict[str, Any]) -> str | None:
    return (spec.get("storage_options") or {}).get("endpoint_url")


def _obstore_client(spec: dict[str, Any], bucket: str, part: int, per_file: int,
                    conc: int) -> tuple[Upload, Download]:
    import concurrent.futures

    import obstore
    from obstore.store import S3Store

    endpoint = _endpoint(spec)
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
                for a, b in _ranges(n, part)]
        with concurrent.futures.ThreadPoolExecutor(conc) as ex:
            got = list(ex.map(lambda j: obstore.get_range(store, j[1], start=j[2], end=j[3]),
                              jobs))
        return [b"".join(bytes(c) for (i, *_), c in zip(jobs, got) if i == f)
                for f in range(len(keys))]

    return _up, _down


def _fsspec_client(spec: dict[str, Any], bucket: str, part: int, per_file: int,
                   conc: int) -> tuple[Upload, Download]:
    import fsspec

    from dcp_volumes.backends import backend_class
    from dcp_volumes.backends.s3 import S3Backend

    protocol = spec["url"].split("://", 1)[0]
    speaks_s3 = issubclass(backend_class(spec["url"]), S3Backend)
    fs = fsspec.filesystem(protocol, asynchronous=False, **(spec.get("storage_options") or {}))
    from fsspec.asyn import sync

    async def _aup(keys: list[str], bodies: list[Any]) -> None:
        if speaks_s3:
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

        chunks = await asyncio.gather(*(asyncio.gather(*(one(k, a, b)
                                                         for a, b in _ranges(n, part)))
                                        for k, n in zip(keys, sizes)))
        return [b"".join(cs) for cs in chunks]

    return (lambda k, b: sync(fs.loop, _aup, k, b)), (lambda k, s: sync(fs.loop, _adown, k, s))


def _boto3_client(spec: dict[str, Any], bucket: str, part: int,
                  per_file: int) -> tuple[Upload, Download]:
    import concurrent.futures

    import boto3
    from boto3.s3.transfer import TransferConfig

    endpoint = _endpoint(spec)
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
