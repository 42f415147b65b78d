"""One rank's files streamed from the source into the destination: rounds of slabs, one
fetched ahead, cast and written into each file's upload, freed memory given back."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
from collections.abc import Callable, Iterator
from typing import Any

from dcp_volumes import errors
from dcp_volumes.export._dest import Destination, tensor_bytes
from dcp_volumes.export._fetch import Source
from dcp_volumes.export._plan import PlannedFile
from dcp_volumes.saving.objects import ObjectWriter

__all__ = ["write_files"]


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc: ``malloc_trim``).

    Each round frees its slabs, casts and upload parts (megabytes each) on several threads;
    glibc raises its mmap threshold after the first such free, so later buffers come from
    per-thread arenas whose freed pages it keeps: without a trim the peak RSS crept up with
    the number of rounds, i.e. with the model (66 MiB over the imports for 32 MiB, 99 MiB
    for 128 MiB; with a trim per round, flat)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None  # not glibc (macOS, musl): nothing to trim


_LIBC = _load_libc()


def write_files(source: Source, out: Destination, files: list[PlannedFile], slab_size: int,
                progress: Callable[[int, int], None] | None) -> None:
    """Stream ``files`` into their uploads: each file's header, then its tensors fetched in
    rounds of row slabs (the next round is fetched while this one is written), cast."""
    total = sum(f.size for f in files)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcpv-export") as pool:

        def feed(pf: PlannedFile, spool: ObjectWriter) -> Iterator[int]:
            spool.write(pf.header_bytes)
            yield spool.tell()
            rounds = source.rounds(pf.tensors, slab_size)
            ahead = pool.submit(source.fetch, rounds[0]) if rounds else None
            for i, rnd in enumerate(rounds):
                assert ahead is not None
                tensors = ahead.result()
                # the next round downloads while this one goes into the upload
                ahead = pool.submit(source.fetch, rounds[i + 1]) if i + 1 < len(rounds) \
                    else None
                for slab, tensor in zip(rnd.slabs, tensors):
                    spool.write(tensor_bytes(tensor, slab.tensor.dtype))
                del tensors
                _trim()
                yield spool.tell()
            if spool.tell() != pf.size:
                raise errors.UploadError(
                    f"internal error: {pf.name} came to {spool.tell()} bytes, its header "
                    f"says {pf.size}")

        out.write(files, feed, None if progress is None else lambda n: progress(n, total))
    if progress is not None:
        progress(total, total)
