"""``export_safetensors``: a committed checkpoint in any store to Hugging Face safetensors.

Per rank: read ``.metadata`` and the manifest (as a load does), plan (pure:
:mod:`~dcp_volumes.export._plan`), take this rank's files, and stream each one: its header
first, then its tensors' bytes in file order, fetched in rounds of row slabs through the
serve path (:mod:`~dcp_volumes.export._fetch`; the next round is fetched while this one is
written) into the file's upload (:mod:`~dcp_volumes.export._dest`). Memory stays near two
rounds (``slab_size`` each, as fetched bytes and as tensors), their casts, and
``max_concurrency + 1`` upload parts, whatever the size of the model or of a file.

Under ``torch.distributed`` the ranks agree at each step (:func:`dcp_volumes._dist.agree`):
rank 0 claims and clears DEST once every rank has planned, every rank checks that it sees
rank 0's claim (one DEST for all), every rank writes its files, and rank 0 commits the index
once every rank's files are durable; a failure on any rank fails every rank with a typed
error, and no index is written. Of two exports racing to one DEST, the one that claimed it
last goes on and the other stops (:mod:`~dcp_volumes.export._lease`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from dcp_volumes import _dist, errors
from dcp_volumes._commit_read import read_committed
from dcp_volumes.backends import open_backend, redact_url
from dcp_volumes.config import MiB, RetryOptions, TransferOptions
from dcp_volumes.export._checks import check_claims, check_not_inside
from dcp_volumes.export._dest import Destination, new_token, tensor_bytes
from dcp_volumes.export._fetch import Source, source_items
from dcp_volumes.export._plan import INDEX, ExportPlan, PlannedFile, assign_files, plan_export
from dcp_volumes.saving import SpoolFile

__all__ = ["ExportReport", "export_safetensors"]

logger = logging.getLogger(__name__)

#: an export's transfer options unless given: 8 requests in flight each way, 8 MiB parts
#: (memory holds ``max_concurrency + 1`` upload parts: 72 MiB; the writer's 16 × 16 MiB would
#: hold 272 MiB for little gain; 8 MiB parts allow 78 GiB per file, far above HF's 5 GB)
DEFAULT_TRANSFER = TransferOptions(max_concurrency=8, part_size=8 * MiB)
#: source bytes fetched per round
DEFAULT_SLAB = 32 * MiB
#: the longest a rank waits for the others at one step (they may be writing big files)
PEER_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote (the whole export; ``bytes_fetched``/``bytes_written`` are this
    rank's).

    Attributes:
        dest: the destination, credentials redacted.
        files: every output file, in order (``model.safetensors``, or the numbered files).
        index: ``model.safetensors.index.json`` for a multi-file export, else None.
        tensors: tensors exported.
        bytes: bytes of every file, headers included.
        total_size: tensor bytes (the index's ``metadata.total_size``).
        skipped: non-tensor items that were selected, and so left out.
        not_selected: items outside ``prefix`` or dropped by ``rename``.
        verified: the source's checksums were checked (False for checkpoints torch wrote).
        seconds: wall time of the export on this rank.
        bytes_fetched: bytes this rank fetched from the source.
        bytes_written: bytes this rank uploaded.
        rank, world_size: this rank and the number of ranks that exported.
    """

    dest: str
    files: tuple[str, ...]
    index: str | None
    tensors: int
    bytes: int
    total_size: int
    skipped: tuple[str, ...]
    not_selected: int
    verified: bool
    seconds: float
    bytes_fetched: int
    bytes_written: int
    rank: int = 0
    world_size: int = 1

    @property
    def mb_per_s(self) -> float:
        """Export throughput, MB (10**6 bytes) of output per second."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["files"], doc["skipped"] = list(self.files), list(self.skipped)
        doc["mb_per_s"] = round(self.mb_per_s, 3)
        return doc


class _Group:
    """The ranks of one export (one rank without ``torch.distributed``)."""

    def __init__(self, task: str) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.group = 0, 1, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.group = _dist.cpu_group("gloo" not in str(dist.get_backend()))
        self.task = task

    def token(self) -> str:
        """The export's token: rank 0's, sent to every rank."""
        return str(_dist.from_rank0(new_token, self.group, self.world > 1))

    def step(self, err: BaseException | None, step: str) -> None:
        """Every rank reports; if any failed, every rank raises (its own error, or the
        failing rank's, typed)."""
        if self.world == 1:
            if err is not None:
                raise err
            return
        _dist.agree(err, group=self.group, world=self.world, me=self.rank,
                    timeout_s=PEER_TIMEOUT_S, task=self.task, step=step,
                    error=errors.UploadError)


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 — reported to every rank by _Group.step
        return None, exc


def _check(transfer: TransferOptions | None, retry: RetryOptions | None, slab_size: int,
           progress: Any, replace: Any) -> TransferOptions:
    if transfer is not None and not isinstance(transfer, TransferOptions):
        raise errors.ConfigError(
            f"transfer= must be a TransferOptions, got {type(transfer).__name__}")
    if retry is not None and not isinstance(retry, RetryOptions):
        raise errors.ConfigError(f"retry= must be a RetryOptions, got {type(retry).__name__}")
    if isinstance(slab_size, bool) or not isinstance(slab_size, int) or slab_size < MiB:
        raise errors.ConfigError(f"slab_size must be an int of at least 1 MiB, got {slab_size!r}")
    if progress is not None and not callable(progress):
        raise errors.ConfigError("progress= must be a callable progress(done, total) or None")
    if not (isinstance(replace, bool) or callable(replace)):
        raise errors.ConfigError("replace= must be True, False or a function "
                                 "replace(names) -> bool")
    return transfer or DEFAULT_TRANSFER


def export_safetensors(
    src: str | os.PathLike[str], dest: str | os.PathLike[str], *, prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None, dtype: str | None = None,
    max_shard_size: int | str = "5GB", storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None, transfer: TransferOptions | None = None,
    retry: RetryOptions | None = None, progress: Callable[[int, int], None] | None = None,
    slab_size: int = DEFAULT_SLAB, replace: bool | Callable[[list[str]], bool] = True,
) -> ExportReport:
    """Export the committed checkpoint at ``src`` to Hugging Face safetensors at ``dest``.

    Under ``torch.distributed`` (torchrun) every rank must call it: the output files are
    split across the ranks by bytes, each fetching only what its files need.

    Args:
        src: a committed checkpoint URL on any backend (checksums verified as on load).
        dest: a URL on any backend, or a local directory, outside ``src``. An earlier export
            there is removed before anything is written (its index or ``model.safetensors``
            first), and the new one appears only when every file is durable.
        prefix: keep only keys under it, stripped (``"model."`` for ``{"model": ...,
            "optim": ...}`` state dicts).
        rename: ``rename(name) -> new name | None`` after the prefix is stripped; None drops
            the tensor.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: cast floating tensors to it.
        max_shard_size: the most tensor bytes per file (``"5GB"`` = 5 * 10**9, Hugging
            Face's default); a bigger tensor gets a file of its own.
        storage_options: fsspec options of ``src``. Never logged.
        dest_storage_options: fsspec options of ``dest`` (default: the same as ``src``'s).
            Never logged.
        transfer: concurrency and part sizes (default: ``TransferOptions(max_concurrency=8,
            part_size=8 * MiB)``; memory holds ``max_concurrency + 1`` upload parts).
        retry: retries of transient errors, both sides.
        progress: ``progress(done, total)``, bytes of this rank's files handed to the upload.
        slab_size: source bytes fetched per round (a tensor is fetched in dim-0 row slabs of
            at most this, when its stored chunks allow partial reads).
        replace: what to do with an earlier export at ``dest``: True removes it, False
            refuses, a function ``replace(names) -> bool`` is asked first (the CLI's prompt).

    Returns:
        An :class:`ExportReport`.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: as a load of ``src`` would.
        IntegrityError: stored bytes or ``.metadata`` claims do not match (nothing commits).
        ConfigError: no tensor is selected, two names collide, a reserved name, an
            unsupported dtype, ``dest`` inside ``src``, a bad option;
            DestinationMismatchError (a ConfigError): the ranks see different ``dest``.
        CheckpointExistsError: ``dest`` holds an earlier export and ``replace`` declined.
        ExportConflictError: another export to ``dest`` started meanwhile and took it over.
        UploadError, DownloadError: the stores failed after retries, or another rank did.
    """
    return _Job(src=src, dest=dest, prefix=prefix, rename=rename, dtype=dtype,
                max_shard_size=max_shard_size, storage_options=storage_options,
                dest_storage_options=(dest_storage_options if dest_storage_options is not None
                                      else storage_options),
                transfer=_check(transfer, retry, slab_size, progress, replace), retry=retry,
                progress=progress, slab_size=slab_size, replace=replace).run()


@dataclass(frozen=True, kw_only=True)
class _Job:
    """One rank's part of an export: the arguments of :func:`export_safetensors`."""

    src: str | os.PathLike[str]
    dest: str | os.PathLike[str]
    prefix: str | None
    rename: Callable[[str], str | None] | None
    dtype: str | None
    max_shard_size: int | str
    storage_options: dict[str, Any] | None
    dest_storage_options: dict[str, Any] | None
    transfer: TransferOptions
    retry: RetryOptions | None
    progress: Callable[[int, int], None] | None
    slab_size: int
    replace: bool | Callable[[list[str]], bool]

    def _open(self, token: str) -> tuple[Source, ExportPlan, Destination]:
        backend = open_backend(self.src, self.storage_options, self.retry)
        dest = open_backend(self.dest, self.dest_storage_options, self.retry)
        check_not_inside(backend, dest)
        committed = read_committed(backend, with_manifest=True)
        source = Source(backend, committed.metadata, committed.manifest,
                        redact_url(os.fspath(self.src)), self.transfer)
        plan = plan_export(source_items(committed.metadata), prefix=self.prefix,
                           rename=self.rename, dtype=self.dtype,
                           max_shard_size=self.max_shard_size)
        check_claims(backend, committed.metadata, (t for f in plan.files for t in f.tensors),
                     source.url)
        out = Destination(dest, self.transfer, token)
        out.check()
        return source, plan, out

    def _claim(self, out: Destination, plan: ExportPlan) -> None:
        """Rank 0: ask about an earlier export (``replace``), then claim and clear DEST."""
        earlier = out.earlier() if self.replace is not True else []
        if earlier and not (callable(self.replace) and self.replace(earlier)):
            raise errors.CheckpointExistsError(
                f"{redact_url(os.fspath(self.dest))} holds an earlier export ({', '.join(earlier)})"
                ", which an export removes before it writes: pass replace=True (--replace) "
                "to replace it, or export to another destination")
        out.claim(plan)

    def run(self) -> ExportReport:
        start = time.monotonic()
        src_url, dest_url = redact_url(os.fspath(self.src)), redact_url(os.fspath(self.dest))
        group = _Group(f"exporting {src_url} to {dest_url}")
        token = group.token()
        opened, err = _attempt(lambda: self._open(token))
        group.step(err, "reading the checkpoint")
        source, plan, out = opened
        if group.rank == 0:
            _, err = _attempt(lambda: self._claim(out, plan))
        group.step(err, "claiming the destination")
        _, err = _attempt(lambda: out.check_same(group.rank))
        group.step(err, "checking that every rank sees the same destination")
        mine = [plan.files[i] for i in assign_files(plan.files, group.world)[group.rank]]
        _, err = _attempt(lambda: _write(source, out, mine, self.slab_size, self.progress))
        group.step(err, "writing files")
        if group.rank == 0:
            _, err = _attempt(lambda: out.commit(plan))
        group.step(err, "committing the index")
        return _report(source, plan, out, group, dest_url, time.monotonic() - start, len(mine))


def _report(source: Source, plan: ExportPlan, out: Destination, group: _Group, dest_url: str,
            seconds: float, mine: int) -> ExportReport:
    report = ExportReport(
        dest=dest_url, files=tuple(f.name for f in plan.files),
        index=None if plan.single else INDEX, tensors=plan.tensors, bytes=plan.file_bytes,
        total_size=plan.total_size, skipped=plan.skipped, not_selected=plan.not_selected,
        verified=source.manifest is not None, seconds=seconds,
        bytes_fetched=source.bytes_fetched, bytes_written=out.bytes_written,
        rank=group.rank, world_size=group.world)
    logger.info("rank %d exported %d tensors in %d files (%d bytes; this rank wrote %d "
                "in %d files) from %s to %s: %.2fs, %.1f MB/s, %d non-tensor items "
                "skipped", group.rank, report.tensors, len(report.files), report.bytes,
                report.bytes_written, mine, source.url, dest_url, report.seconds,
                report.mb_per_s, len(report.skipped))
    return report


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


def _write(source: Source, out: Destination, files: list[PlannedFile], slab_size: int,
           progress: Callable[[int, int], None] | None) -> None:
    total = sum(f.size for f in files)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcpv-export") as pool:

        def feed(pf: PlannedFile, spool: SpoolFile) -> Iterator[int]:
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
