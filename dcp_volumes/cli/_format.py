"""Output shared by the commands: JSON, tables (rich on a terminal, plain text in pipes),
sizes, times, redacted URLs and progress bars."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "human_bytes",
    "plural",
    "print_json",
    "print_table",
    "progress_bar",
    "redact",
    "when",
]


def print_json(doc: Any) -> None:
    # allow_nan=False: a stray inf must fail here, not produce invalid JSON downstream.
    print(json.dumps(doc, indent=2, allow_nan=False))


def redact(url: str) -> str:
    from dcp_volumes.backends.translate import redact_url

    return redact_url(url)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    t = _dt.datetime.fromtimestamp(epoch, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def print_table(
    headers: list[str],
    rows: list[list[str]],
    *,
    right: set[int] = frozenset(),  # type: ignore[assignment]
    styles: Sequence[str | None] | None = None,
) -> None:
    """A table on stdout: rich on a terminal (when installed), aligned plain text otherwise,
    so pipes get every character of every cell."""
    try:
        if not sys.stdout.isatty():
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            ).rstrip()

        print(line(headers))
        print(line(["-" * w for w in widths]))
        for cells in rows:
            print(line(cells))
        return
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i in right else "left", overflow="fold")
    for n, cells in enumerate(rows):
        table.add_row(*cells, style=styles[n] if styles is not None else None)
    Console(highlight=False, soft_wrap=True).print(table)


@contextlib.contextmanager
def progress_bar(
    what: str, *, enabled: bool, unit: str
) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr when it is a terminal (rich, else tqdm); else nothing."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TimeRemainingColumn,
        )
    except ImportError:
        try:
            from tqdm import tqdm
        except ImportError:
            yield None
            return
        bar = tqdm(
            desc=what, unit="B" if unit == "bytes" else " objects", unit_scale=True, file=sys.stderr
        )

        def tick_tqdm(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            yield tick_tqdm
        finally:
            bar.close()
        return
    counter = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    with Progress(
        f"[bold]{what}[/bold]",
        BarColumn(),
        counter,
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield tick

