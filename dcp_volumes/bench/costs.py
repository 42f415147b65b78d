"""The checkpoint cost ``δ`` that ``dcp-volumes plan --from-bench`` reads from bench results.

``dcp-volumes bench`` writes one JSON object per measurement; a hand-written file with one
object per line (``{"contender": ..., "save_s": ...}``) works as well. The goodput model
(:mod:`dcp_volumes.goodput`) takes the cost as a number and never reads these files.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp_volumes.errors import ConfigError

__all__ = ["BenchCost", "checkpoint_cost_from_bench"]


@dataclass(frozen=True, kw_only=True)
class BenchCost:
    """A checkpoint cost ``δ`` read from a ``dcp-volumes bench`` JSON-lines file.

    Args:
        seconds: Median of ``metric`` over the matching lines.
        metric: ``"save_s"`` (blocking save) or ``"async_block_s"`` (time ``async_save``
            blocks training).
        samples: Lines the median was taken over.
        contender: The contender filter, or ``None`` for every line.
        path: The file read.
    """

    seconds: float
    metric: str
    samples: int
    contender: str | None
    path: str

    def describe(self) -> str:
        """One line saying where ``δ`` came from."""
        who = f", contender {self.contender!r}" if self.contender is not None else ""
        return f"median {self.metric} of {self.samples} run(s) in {self.path}{who}"


def checkpoint_cost_from_bench(
    path: str | Path,
    /,
    *,
    contender: str | None = None,
    use_async: bool = False,
) -> BenchCost:
    """Median checkpoint cost from a ``dcp-volumes bench`` JSON-lines result file.

    Each line that parses as a JSON object with a finite, non-negative number under the
    metric counts; blank lines, ``#`` comments, markdown table lines and other non-JSON text
    are skipped, so a captured bench stdout can be passed as is.

    Args:
        path: The JSON-lines file.
        contender: Keep only lines whose ``"contender"`` equals this.
        use_async: Read ``async_block_s`` (time ``async_save`` blocks training) instead of
            ``save_s`` (a blocking save).

    Returns:
        The median, with how many lines it came from.

    Raises:
        ConfigError: The file cannot be read, or no line matches; the message lists the
            contenders and metrics the file does have.
    """
    metric = "async_block_s" if use_async else "save_s"
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(
            f"bench file {str(p)!r} does not exist; write one with `dcp-volumes bench ... > "
            f"{p.name}` or give the checkpoint cost directly"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read bench file {str(p)!r}: {exc}") from exc

    records = list(_json_objects(text.splitlines()))
    values = [
        v
        for rec in records
        if contender is None or rec.get("contender") == contender
        if (v := _bench_value(_metric_of(rec, metric))) is not None
    ]
    if not values:
        raise ConfigError(_no_match_message(p, records, metric=metric, contender=contender))
    return BenchCost(
        seconds=float(statistics.median(values)),
        metric=metric,
        samples=len(values),
        contender=contender,
        path=str(p),
    )


def _metric_of(rec: Mapping[str, Any], metric: str) -> Any:
    """A metric from a bench line: top level, or under ``result`` (``dcp-volumes bench``)."""
    if metric in rec:
        return rec[metric]
    result = rec.get("result")
    return result.get(metric) if isinstance(result, Mapping) else None


def _json_objects(lines: Iterable[str]) -> Iterable[Mapping[str, Any]]:
    for line in lines:
        s = line.strip()
        if not s.startswith("{"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj


def _bench_value(raw: object) -> float | None:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    if not math.isfinite(raw) or raw < 0:
        return None
    return float(raw)


def _no_match_message(
    path: Path, records: Sequence[Mapping[str, Any]], *, metric: str, contender: str | None
) -> str:
    if not records:
        return f"bench file {str(path)!r} holds no JSON-object lines; is it `dcp-volumes bench` output?"
    contenders = sorted({str(r["contender"]) for r in records if "contender" in r})
    listed = ", ".join(contenders) if contenders else "none named"
    if contender is not None and contender not in contenders:
        return (
            f"no line in bench file {str(path)!r} has contender {contender!r}; "
            f"contenders there: {listed}"
        )
    other = "save_s" if metric == "async_block_s" else "async_block_s"
    hint = ""
    if any(_bench_value(_metric_of(r, other)) is not None for r in records):
        switch = (
            "drop --async (use_async=False)"
            if other == "save_s"
            else ("pass --async (use_async=True)")
        )
        hint = f"; lines do have {other!r}: {switch} to read it"
    who = f" for contender {contender!r}" if contender is not None else ""
    return (
        f"no line in bench file {str(path)!r} has a number under {metric!r}{who}{hint}"
        f" (contenders there: {listed})"
    )

