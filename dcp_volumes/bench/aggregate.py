"""Aggregating ``dcp-volumes bench`` JSON lines: medians with min–max per contender and profile,
the raw ceiling, and the small formatting helpers the report and the plots share."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MiB",
    "Record",
    "Row",
    "Stat",
    "ceiling",
    "find_row",
    "fmt_stat",
    "fx",
    "group",
    "med_of",
    "mibs",
    "ok_records",
    "ratio_of",
    "read_jsonl",
    "save_rows",
    "stat_from",
    "stat_of",
]

MiB = 1 << 20
Record = dict[str, Any]


def read_jsonl(path: str | Path) -> list[Record]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -------------------------------------------------------------------------------------------
# aggregation


@dataclass
class Stat:
    values: list[float]

    @property
    def med(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, digits: int = 2) -> str:
        if len(self.values) == 1:
            return f"{self.med:.{digits}f}"
        return f"{self.med:.{digits}f} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"


def stat_from(values: Iterable[float | None]) -> Stat | None:
    vs = [float(v) for v in values if v is not None]
    return Stat(vs) if vs else None


def ok_records(records: list[Record]) -> list[Record]:
    return [r for r in records if "result" in r]


def group(records: list[Record], kind: str | tuple[str, ...],
           key: Callable[[Record], Any] = lambda r: (r["profile"], r["contender"])
           ) -> dict[Any, list[Record]]:
    kinds = (kind,) if isinstance(kind, str) else kind
    out: dict[Any, list[Record]] = defaultdict(list)
    for r in ok_records(records):
        if r["kind"] in kinds:
            out[key(r)].append(r)
    return out


def stat_of(rs: list[Record], fn: Callable[[dict[str, Any]], float | None]) -> Stat | None:
    vals = []
    for r in rs:
        try:
            vals.append(fn(r["result"]))
        except (KeyError, TypeError, ZeroDivisionError):
            vals.append(None)
    return stat_from(vals)


def mibs(field: str) -> Callable[[dict[str, Any]], float]:
    return lambda x: x["bytes"] / MiB / x[field]


@dataclass
class Row:
    profile: str
    contender: str
    n: int
    save_s: Stat | None
    save_mibs: Stat | None
    load_s: Stat | None
    load_mibs: Stat | None
    rss: Stat | None
    spool_s: Stat | None = None
    upload_tail_s: Stat | None = None
    commit_s: Stat | None = None
    save_cpu_s: Stat | None = None
    load_cpu_s: Stat | None = None


def save_rows(records: list[Record]) -> list[Row]:
    rows = []
    for (profile, contender), rs in group(records, ("save_load", "raw")).items():
        def ws(k: str) -> Callable[[dict[str, Any]], Any]:
            return lambda x: (x.get("writer_stats") or {}).get(k)

        rows.append(Row(
            profile, contender, len(rs),
            stat_of(rs, lambda x: x["save_s"]), stat_of(rs, mibs("save_s")),
            stat_of(rs, lambda x: x["load_s"]), stat_of(rs, mibs("load_s")),
            stat_of(rs, lambda x: x.get("save_rss_peak_mib")),
            stat_of(rs, ws("spool_s")), stat_of(rs, ws("upload_tail_s")), stat_of(rs, ws("commit_s")),
            stat_of(rs, lambda x: x.get("save_cpu_s")), stat_of(rs, lambda x: x.get("load_cpu_s")),
        ))
    order = {p: i for i, p in enumerate(("direct", "s3-like"))}
    rows.sort(key=lambda r: (order.get(r.profile, 9), _contender_order(r.contender)))
    return rows


def _contender_order(c: str) -> tuple[int, str]:
    for i, prefix in enumerate(("vol-disk", "vol-memory", "fsspec", "s3tc", "local", "raw")):
        if c.startswith(prefix):
            return i, c.rjust(20)
    return 9, c


def ceiling(rows: list[Row], profile: str, which: str) -> Row | None:
    """The raw client with the best median throughput (``which``: save | load)."""
    raws = [r for r in rows if r.profile == profile and r.contender.startswith("raw-")
            and getattr(r, f"{which}_mibs") is not None]
    if not raws:
        return None
    return max(raws, key=lambda r: getattr(r, f"{which}_mibs").med)


def find_row(rows: list[Row], profile: str, contender: str) -> Row | None:
    for r in rows:
        if r.profile == profile and r.contender == contender:
            return r
    return None


def ratio_of(a: Stat | None, b: Stat | None) -> float | None:
    if a is None or b is None or b.med == 0:
        return None
    return a.med / b.med


def med_of(s: Stat | None, scale: float = 1.0) -> float | None:
    return None if s is None else s.med * scale


def fx(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"



def fmt_stat(s: Stat | None, digits: int) -> str:
    return s.fmt(digits) if s else "—"

