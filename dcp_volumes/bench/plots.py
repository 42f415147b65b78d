"""The ``dcp-volumes bench`` plots: throughput by contender, async_save blocking time against
the memory-copy floor, and rank scaling (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcp_volumes.bench.aggregate import Record, Row, ceiling, group, mibs, save_rows, stat_of

__all__ = ["write_plots"]


def write_plots(records: list[Record], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    rows = save_rows(records)
    if rows:
        written.append(_throughput(plt, rows, out_dir / "throughput.png"))
    asyncs = group(records, "async", key=lambda r: (r["profile"],))
    if asyncs:
        written.append(_async_blocking(plt, asyncs, out_dir / "async_blocking.png"))
    scal = group(records, "scaling", key=lambda r: (r["profile"], r["layout"]))
    if scal:
        written.append(_scaling(plt, scal, out_dir / "scaling.png"))
    return written


def _throughput(plt: Any, rows: list[Row], path: Path) -> Path:
    profiles = [p for p in ("direct", "s3-like") if any(r.profile == p for r in rows)]
    fig, axes = plt.subplots(len(profiles), 1, figsize=(11, 3.8 * len(profiles)),
                             squeeze=False)
    for ax, profile in zip(axes[:, 0], profiles):
        rs = [r for r in rows if r.profile == profile]
        xs = range(len(rs))
        for off, which, color in ((-0.2, "save", "tab:blue"), (0.2, "load", "tab:orange")):
            stats = [getattr(r, f"{which}_mibs") for r in rs]
            med = [s.med if s else 0 for s in stats]
            err = [[s.med - s.lo if s else 0 for s in stats],
                   [s.hi - s.med if s else 0 for s in stats]]
            ax.bar([x + off for x in xs], med, 0.4, yerr=err, capsize=2, label=which,
                   color=color)
        tops = [getattr(r, f"{w}_mibs").med for r in rs for w in ("save", "load")
                if getattr(r, f"{w}_mibs")]
        if tops and max(tops) > 12 * min(tops):
            ax.set_yscale("log")  # the local-disk reference dwarfs the object stores
        c = ceiling(rows, profile, "save")
        if c and c.save_mibs:
            ax.axhline(c.save_mibs.med, ls="--", color="tab:blue", lw=1,
                       label=f"raw upload ceiling ({c.contender})")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r.contender for r in rs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MiB/s (median, min–max)" + (", log" if ax.get_yscale() == "log"
                                                     else ""))
        ax.set_title(f"throughput by contender — {profile}")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _async_blocking(plt: Any, asyncs: dict[Any, list[Record]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels, vals, errs = [], [], []
    shown = ("direct",) if ("direct",) in asyncs else next(iter(asyncs))
    direct = asyncs[shown]
    for label, fn in (("copy into prealloc\n(floor)", lambda x: x["copy_prealloc_s"]),
                      ("fresh clone\n(floor)", lambda x: x["copy_clone_s"]),
                      ("VolumeWriter kept\nasync_save #2+", lambda x: x["async_block_s"]),
                      ("fresh VolumeWriter\nper step, #2+", lambda x: x.get("async_fresh_block_s")),
                      ("VolumeWriter\nasync_save #1", lambda x: x["async_first_block_s"]),
                      ("torch DefaultStager\n(FsspecWriter)",
                       lambda x: x.get("torch_stager_block_s"))):
        s = stat_of(direct, fn)
        if s:
            labels.append(label)
            vals.append(s.med * 1e3)
            errs.append((s.med * 1e3 - s.lo * 1e3, s.hi * 1e3 - s.med * 1e3))
    ax.bar(range(len(vals)), vals, yerr=list(zip(*errs)) if errs else None, capsize=3,
           color=["tab:gray", "tab:gray", "tab:green", "tab:green", "tab:olive",
                  "tab:red"][:len(vals)])
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("ms until control returns")
    ax.set_title(f"async_save blocking time vs the memory-copy floor ({shown[0]}; "
                 "median, min–max)")
    return _save(plt, fig, path)


def _scaling(plt: Any, scal: dict[Any, list[Record]], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for (profile, layout), recs in sorted(scal.items()):
        worlds = sorted({r["world"] for r in recs})
        for ax, field in zip(axes, ("save_s", "load_s")):
            meds = []
            for w in worlds:
                st = stat_of([r for r in recs if r["world"] == w], mibs(field))
                meds.append(st.med if st else 0)
            ax.plot(worlds, meds, marker="o", label=f"{layout} ({profile})")
    for ax, what in zip(axes, ("save", "load")):
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r["world"] for rs in scal.values() for r in rs}))
        ax.set_xlabel("ranks (gloo, one host)")
        ax.set_ylabel("MiB/s of state (median)")
        ax.set_title(f"{what}: scaling with ranks, total size fixed")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
