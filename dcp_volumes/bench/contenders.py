"""The contenders: names such as ``vol-disk-c8`` or ``fsspec-t1``, and their writers and readers.

Raw-client contenders (``raw-*``) have no writer or reader; :mod:`dcp_volumes.bench.raw`
runs them.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["last_stats", "make_reader", "make_writer", "parse_contender"]


def parse_contender(name: str) -> dict[str, Any]:
    """``vol-disk`` → {family: vol, spool: disk, concurrency: None} (the defaults: adaptive);
    ``vol-disk-c8`` → concurrency fixed at 8; ``vol-cached``: the disk spool through the page
    cache (``SpoolOptions(direct_io=False)``; ``vol-disk`` writes it with O_DIRECT); ``fsspec-t1``; ``s3tc-t8``; ``local-fs``;
    ``raw-obstore`` / ``raw-s3fs`` / ``raw-boto3``, optionally ``-cN`` requests in flight."""
    parts = name.split("-")
    if parts[0] == "vol" and len(parts) in (2, 3) and parts[1] in ("disk", "memory",
                                                                    "cached"):
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
            spool=SpoolOptions(mode="memory" if c["spool"] == "memory" else "disk",
                               directory=spec.get("spool_dir"),
                               direct_io=False if c["spool"] == "cached" else None),
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


def last_stats(obj: Any) -> dict[str, Any] | None:
    st = getattr(obj, "last_stats", None)
    return st.as_dict() if st is not None else None

