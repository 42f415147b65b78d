"""Verify: read a checkpoint back and check it against its manifest.

Each file's size is checked here first; the items of the files of the right size are read
back and checked as a load checks them by :mod:`._verify_read`, so ``verify`` passes exactly
when a load would find every byte intact. The reports: :mod:`._verify_report`.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, redact_url
from dcp_volumes.catalog._committed import CommittedSave, load_committed
from dcp_volumes.catalog._common import Progress, open_root
from dcp_volumes.catalog._verify_read import fetch_and_check, reads_of
from dcp_volumes.catalog._verify_report import FileReport, VerifyReport

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_volumes._manifest import Manifest

__all__ = ["verify"]


def verify(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    max_concurrency: int = 4,
    chunk_size: int = 16 << 20,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read every item of a checkpoint back and check sizes and CRC32C against its manifest.

    Each file's size is checked first (a missing or resized file is not read); the items of
    the others are fetched in ranged reads of up to ``chunk_size`` bytes, ``max_concurrency``
    at a time, and checked as a load checks them. A checkpoint written by torch's own writers
    has no manifest: nothing to verify, but the files named in ``.metadata`` must exist and be
    large enough for the items they hold.

    Args:
        url: the checkpoint.
        storage_options: passed to fsspec unchanged; never logged.
        max_concurrency: requests in flight at the same time.
        chunk_size: bytes per ranged read.
        progress: called as ``progress(bytes_done, bytes_total)`` while reading.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``url``.
        IncompleteCheckpointError: objects but no ``.metadata``.
    """
    if max_concurrency < 1 or chunk_size < 1:
        raise errors.ConfigError("max_concurrency and chunk_size must be >= 1")
    backend = open_root(url, storage_options)
    save = load_committed(backend)
    needed = _needed_sizes(save.metadata)
    if save.manifest is None:
        return _unverified(backend, save, needed, max_concurrency)
    return _checksummed(backend, save, needed, max_concurrency, chunk_size, progress)


def _checksummed(backend: Backend, save: CommittedSave, needed: dict[str, int],
                 limit: int, chunk_size: int, progress: Progress | None) -> VerifyReport:
    """A manifest: every file's size, then every item's bytes read back and checked."""
    assert save.manifest is not None
    files = _check_sizes_against_manifest(backend, save.manifest, limit)
    reads = reads_of(save.metadata, save.manifest, files, chunk_size)
    read = fetch_and_check(backend, reads, files, limit, chunk_size, progress)
    reports = [files[name] for name in sorted(files)]
    for name in sorted(set(needed) - set(save.manifest.files)):
        reports.append(FileReport(name, "not in manifest", needed[name]))
    n_items = sum(len(e.items) for e in save.manifest.files.values())
    note = f"checked size and CRC32C of {n_items} items"
    return VerifyReport(redact_url(backend.url), save.save_id, True, note, reports, read)


# --------------------------------------------------------------------------------------------
# Sizes


def _needed_sizes(md: Metadata) -> dict[str, int]:
    """The least size of each file named in ``.metadata``: the end of its last item."""
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    return needed


#: the stored "size" of a file that resolves outside the checkpoint (a symbolic link)
_ESCAPES = -1
_ESCAPES_STATUS = "link outside the checkpoint"


def _stored_sizes(backend: Backend, names: list[str], limit: int) -> dict[str, int | None]:
    """Each object's stored size (fresh, not from a listing cache); None where absent."""

    async def _all() -> list[int | None]:
        gate = asyncio.Semaphore(limit)

        async def one(name: str) -> int | None:
            async with gate:
                try:
                    return await backend.size(name)
                except errors.UnsafeCheckpointError:
                    return _ESCAPES  # a link out of the checkpoint: reported, never read

        return list(await asyncio.gather(*(one(n) for n in names)))

    return dict(zip(names, backend.run(_all)))


def _unverified(
    backend: Backend, save: CommittedSave, needed: dict[str, int], limit: int
) -> VerifyReport:
    """No manifest: check that the files named in ``.metadata`` exist and are large enough."""
    sizes = _stored_sizes(backend, sorted(needed), limit)
    files = []
    for name, size in sorted(needed.items()):
        actual = sizes[name]
        if actual is None:
            files.append(FileReport(name, "missing", size))
        elif actual == _ESCAPES:
            files.append(FileReport(name, _ESCAPES_STATUS, size))
        else:
            files.append(
                FileReport(name, "ok" if actual >= size else "size mismatch", size, actual)
            )
    if save.ours:
        assert save.manifest_problem is not None
        name = _layout.manifest_name(save.save_id)  # type: ignore[arg-type]
        files.insert(0, FileReport(name, "missing", 0))
        note = f"{save.manifest_problem}: checksums cannot be verified"
    else:
        note = (
            "no manifest: nothing to verify (not written by dcp_volumes); checked that "
            "the files named in .metadata exist and are large enough"
        )
    return VerifyReport(redact_url(backend.url), save.save_id, False, note, files)


def _check_sizes_against_manifest(
    backend: Backend, manifest: Manifest, limit: int
) -> dict[str, FileReport]:
    """One report per manifest file: ``ok`` so far, ``missing`` or ``size mismatch``."""
    sizes = _stored_sizes(backend, sorted(manifest.files), limit)
    files = {}
    for name, actual in sizes.items():
        size = manifest.files[name].size
        if actual is None:
            files[name] = FileReport(name, "missing", size)
        elif actual == _ESCAPES:
            files[name] = FileReport(name, _ESCAPES_STATUS, size)
        else:
            files[name] = FileReport(
                name, "ok" if actual == size else "size mismatch", size, actual
            )
    return files
