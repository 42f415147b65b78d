"""``export_safetensors``: a committed checkpoint in any store to Hugging Face safetensors.

Per rank: read ``.metadata`` and the manifest (as a load does), select the tensors (pure:
:mod:`~dcp_volumes.export._plan`), check every claim and transform, prove the tied
duplicates to leave out (:mod:`~dcp_volumes.export._ties`: rank 0 compares the bytes, every
rank gets its answer), plan the files, take this rank's, and stream each one
(:mod:`~dcp_volumes.export._stream`): its header first, then its tensors' bytes in file
order, fetched in rounds of row slabs through the serve path
(:mod:`~dcp_volumes.export._fetch`) into the file's upload
(:mod:`~dcp_volumes.export._dest`). Memory stays near two rounds (``slab_size`` each, as
fetched bytes and as tensors), their casts, and ``max_concurrency + 1`` upload parts,
whatever the size of the model or of a file.

Under ``torch.distributed`` the ranks agree at each step (:mod:`~dcp_volumes.export._group`):
rank 0 claims and clears DEST once every rank has planned, every rank checks that it sees
rank 0's claim (one DEST for all), every rank writes its files, and rank 0 commits the index
once every rank's files are durable; a failure on any rank fails every rank with a typed
error, and no index is written. Of two exports racing to one DEST, the one that claimed it
last goes on and the other stops (:mod:`~dcp_volumes.export._lease`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dcp_volumes import errors
from dcp_volumes._commit_read import read_committed
from dcp_volumes.backends import open_backend, redact_url
from dcp_volumes.config import MiB, RetryOptions, TransferOptions
from dcp_volumes.export import _ties
from dcp_volumes.export._checks import check_claims, check_decodable, check_not_inside
from dcp_volumes.export._dest import Destination
from dcp_volumes.export._fetch import Source, source_items
from dcp_volumes.export._group import Group, attempt
from dcp_volumes.export._options import parse_size
from dcp_volumes.export._plan import ExportPlan, Selection, plan_files, select_tensors
from dcp_volumes.export._report import ExportReport, build_report
from dcp_volumes.export._stream import write_files
from dcp_volumes.export._work import assign_files
from dcp_volumes.transfer.transforms import checked_registry

__all__ = ["ExportReport", "export_safetensors"]

#: an export's transfer options unless given: 8 requests in flight each way, 8 MiB parts
#: (memory holds ``max_concurrency + 1`` upload parts: 72 MiB; the writer's 16 × 16 MiB would
#: hold 272 MiB for little gain; 8 MiB parts allow 78 GiB per file, far above HF's 5 GB)
DEFAULT_TRANSFER = TransferOptions(max_concurrency=8, part_size=8 * MiB)
#: source bytes fetched per round
DEFAULT_SLAB = 32 * MiB


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
    max_shard_size: int | str = "5GB", tied: str | Mapping[str, str] = "auto",
    storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None, transfer: TransferOptions | None = None,
    retry: RetryOptions | None = None, progress: Callable[[int, int], None] | None = None,
    slab_size: int = DEFAULT_SLAB, replace: bool | Callable[[list[str]], bool] = True,
    extension_registry: Any = None,
) -> ExportReport:
    """Export the committed checkpoint at ``src`` to Hugging Face safetensors at ``dest``;
    under ``torch.distributed`` every rank calls it and writes its share of the files.

    Args:
        src: a committed checkpoint URL on any backend (checksums verified as on load).
        dest: a URL or local directory outside ``src``. An earlier export there is removed
            first (its commit first); the new one appears when every file is durable.
        prefix: keep only keys under it, stripped (``"model."``).
        rename: ``rename(name) -> new name | None`` after the prefix; None drops the tensor.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: cast floating tensors to it.
        max_shard_size: the most tensor bytes per file (``"5GB"`` = 5 * 10**9).
        tied: tied duplicates to leave out, as ``save_pretrained`` does: ``"auto"``
            (``lm_head.weight`` when byte-equal to the one tensor of its dtype and shape it
            matches), ``{name: kept name}`` (each checked byte-equal), or ``"keep"``.
        storage_options: fsspec options of ``src``. Never logged.
        dest_storage_options: fsspec options of ``dest`` (default: ``src``'s). Never logged.
        transfer: concurrency and part sizes (default 8 requests, 8 MiB parts).
        retry: retries of transient errors, both sides.
        progress: ``progress(done, total)``, bytes of this rank's files handed to the upload.
        slab_size: source bytes fetched per round (dim-0 row slabs where chunks allow).
        replace: an earlier export at ``dest``: True removes it, False refuses, a function
            ``replace(names) -> bool`` is asked first.
        extension_registry: torch's ``ExtensionRegistry`` decoding the custom stream
            transforms the checkpoint was written through (zstd needs none).

    Returns:
        An :class:`ExportReport`.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: as a load of ``src`` would.
        IntegrityError: stored bytes or ``.metadata`` claims do not match (nothing commits).
        UnsupportedTransformError: a transform that cannot be decoded (before any fetch).
        ConfigError: nothing selected, names collide or are reserved, a bad tie or option,
            ``dest`` inside ``src``; DestinationMismatchError: ranks see different ``dest``.
        CheckpointExistsError: ``dest`` holds an earlier export and ``replace`` declined.
        ExportConflictError: another export to ``dest`` started meanwhile and took it over.
        UploadError, DownloadError: the stores failed after retries, or another rank did.
    """
    return _Job(src=src, dest=dest, prefix=prefix, rename=rename, dtype=dtype,
                max_shard_size=max_shard_size, tied=_ties.checked_tied(tied),
                storage_options=storage_options, dest_storage_options=(
                    storage_options if dest_storage_options is None else dest_storage_options),
                transfer=_check(transfer, retry, slab_size, progress, replace), retry=retry,
                progress=progress, slab_size=slab_size, replace=replace,
                registry=checked_registry(extension_registry)).run()


@dataclass(frozen=True)
class _Opened:
    """A rank's export once SRC is read and checked: what it selects, what may be tied."""

    source: Source
    selection: Selection
    candidates: list[_ties.Candidate]
    out: Destination


@dataclass(frozen=True, kw_only=True)
class _Job:
    """One rank's part of an export: the arguments of :func:`export_safetensors`."""

    src: str | os.PathLike[str]
    dest: str | os.PathLike[str]
    prefix: str | None
    rename: Callable[[str], str | None] | None
    dtype: str | None
    max_shard_size: int | str
    tied: str | dict[str, str]
    storage_options: dict[str, Any] | None
    dest_storage_options: dict[str, Any] | None
    transfer: TransferOptions
    retry: RetryOptions | None
    progress: Callable[[int, int], None] | None
    slab_size: int
    replace: bool | Callable[[list[str]], bool]
    registry: Any

    def _open(self, token: str) -> _Opened:
        backend = open_backend(self.src, self.storage_options, self.retry)
        dest = open_backend(self.dest, self.dest_storage_options, self.retry)
        check_not_inside(backend, dest)
        committed = read_committed(backend, with_manifest=True)
        source = Source(backend, committed.metadata, committed.manifest,
                        redact_url(os.fspath(self.src)), self.transfer, self.registry)
        parse_size(self.max_shard_size)
        selection = select_tensors(source_items(committed.metadata), prefix=self.prefix,
                                   rename=self.rename, dtype=self.dtype)
        check_claims(backend, committed.metadata, selection.tensors, source.url)
        check_decodable(committed.metadata, selection.tensors, self.registry, source.url)
        found = _ties.candidates(selection.tensors, self.tied)
        out = Destination(dest, self.transfer, token)
        out.check()
        return _Opened(source, selection, found, out)

    def _plan(self, opened: _Opened, group: Group) -> ExportPlan:
        """Rank 0 proves the ties (it reads the candidates' bytes), every rank plans."""
        tied = group.from_rank0(lambda: _ties.resolve(
            opened.candidates, lambda a, b: opened.source.equal(a, b, self.slab_size)))
        return plan_files(opened.selection, self.max_shard_size, tied)

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
        dest_url = redact_url(os.fspath(self.dest))
        group = Group(f"exporting {redact_url(os.fspath(self.src))} to {dest_url}")
        token = group.token()
        opened, err = attempt(lambda: self._open(token))
        group.step(err, "reading the checkpoint")
        source, out = opened.source, opened.out
        plan = self._plan(opened, group)  # rank 0's error, if any, on every rank
        if group.rank == 0:
            _, err = attempt(lambda: self._claim(out, plan))
        group.step(err, "claiming the destination")
        _, err = attempt(lambda: out.check_same(group.rank))
        group.step(err, "checking that every rank sees the same destination")
        mine = [plan.files[i] for i in assign_files(plan.files, group.world)[group.rank]]
        _, err = attempt(lambda: write_files(source, out, mine, self.slab_size, self.progress))
        group.step(err, "writing files")
        if group.rank == 0:
            _, err = attempt(lambda: out.commit(plan))
        group.step(err, "committing the index")
        return build_report(source, plan, out, group, dest_url, time.monotonic() - start,
                            len(mine))
