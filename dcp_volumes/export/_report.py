"""What an export reports: :class:`ExportReport`, built and logged once per rank."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from dcp_volumes.export._dest import Destination
from dcp_volumes.export._fetch import Source
from dcp_volumes.export._group import Group
from dcp_volumes.export._plan import INDEX, ExportPlan

__all__ = ["ExportReport", "build_report"]

logger = logging.getLogger(__name__)


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
        tied: ``(name, kept name)`` of each tied duplicate left out (``tied=``).
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
    tied: tuple[tuple[str, str], ...] = ()

    @property
    def mb_per_s(self) -> float:
        """Export throughput, MB (10**6 bytes) of output per second."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["files"], doc["skipped"] = list(self.files), list(self.skipped)
        doc["tied"] = [list(pair) for pair in self.tied]
        doc["mb_per_s"] = round(self.mb_per_s, 3)
        return doc


def build_report(source: Source, plan: ExportPlan, out: Destination, group: Group,
                 dest_url: str, seconds: float, mine: int) -> ExportReport:
    """The report of an export (logged at INFO on each rank)."""
    report = ExportReport(
        dest=dest_url, files=tuple(f.name for f in plan.files),
        index=None if plan.single else INDEX, tensors=plan.tensors, bytes=plan.file_bytes,
        total_size=plan.total_size, skipped=plan.skipped, not_selected=plan.not_selected,
        verified=source.manifest is not None, seconds=seconds,
        bytes_fetched=source.bytes_fetched, bytes_written=out.bytes_written,
        rank=group.rank, world_size=group.world, tied=plan.tied)
    logger.info("rank %d exported %d tensors in %d files (%d bytes; this rank wrote %d "
                "in %d files) from %s to %s: %.2fs, %.1f MB/s, %d non-tensor items "
                "skipped, %d tied duplicates left out", group.rank, report.tensors, len(report.files), report.bytes,
                report.bytes_written, mine, source.url, dest_url, report.seconds,
                report.mb_per_s, len(report.skipped), len(report.tied))
    return report
