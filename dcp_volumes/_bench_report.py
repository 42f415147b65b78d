"""Turn ``dcp-volumes bench`` JSON lines into a markdown report, target verdicts and plots.

Ratios are throughput ratios (``contender MiB/s ÷ reference MiB/s``), so above 1 is faster,
except where a row says otherwise (time or byte ratios, where below 1 is better).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp_volumes.config import TransferOptions

__all__ = ["read_jsonl", "render_markdown", "targets", "write_report"]

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


def _stat(values: Iterable[float | None]) -> Stat | None:
    vs = [float(v) for v in values if v is not None]
    return Stat(vs) if vs else None


def _ok(records: list[Record]) -> list[Record]:
    return [r for r in records if "result" in r]


def _group(records: list[Record], kind: str | tuple[str, ...],
           key: Callable[[Record], Any] = lambda r: (r["profile"], r["contender"])
           ) -> dict[Any, list[Record]]:
    kinds = (kind,) if isinstance(kind, str) else kind
    out: dict[Any, list[Record]] = defaultdict(list)
    for r in _ok(records):
        if r["kind"] in kinds:
            out[key(r)].append(r)
    return out


def _res(rs: list[Record], fn: Callable[[dict[str, Any]], float | None]) -> Stat | None:
    vals = []
    for r in rs:
        try:
            vals.append(fn(r["result"]))
        except (KeyError, TypeError, ZeroDivisionError):
            vals.append(None)
    return _stat(vals)


def _mibs(field: str) -> Callable[[dict[str, Any]], float]:
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
    for (profile, contender), rs in _group(records, ("save_load", "raw")).items():
        def ws(k: str) -> Callable[[dict[str, Any]], Any]:
            return lambda x: (x.get("writer_stats") or {}).get(k)

        rows.append(Row(
            profile, contender, len(rs),
            _res(rs, lambda x: x["save_s"]), _res(rs, _mibs("save_s")),
            _res(rs, lambda x: x["load_s"]), _res(rs, _mibs("load_s")),
            _res(rs, lambda x: x.get("save_rss_peak_mib")),
            _res(rs, ws("spool_s")), _res(rs, ws("upload_tail_s")), _res(rs, ws("commit_s")),
            _res(rs, lambda x: x.get("save_cpu_s")), _res(rs, lambda x: x.get("load_cpu_s")),
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


def _find(rows: list[Row], profile: str, contender: str) -> Row | None:
    for r in rows:
        if r.profile == profile and r.contender == contender:
            return r
    return None


def _ratio(a: Stat | None, b: Stat | None) -> float | None:
    if a is None or b is None or b.med == 0:
        return None
    return a.med / b.med


def _med(s: Stat | None, scale: float = 1.0) -> float | None:
    return None if s is None else s.med * scale


def _fx(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


# -------------------------------------------------------------------------------------------
# targets


@dataclass
class Target:
    name: str
    measured: str
    ratio: float | None
    goal: str
    passed: bool | None


DEFAULT_VOL = "vol-disk"


def _parse_conc(contender: str) -> int | None:
    try:
        return int(contender.rsplit("-c", 1)[1])
    except (IndexError, ValueError):
        return None


def _load_ratio(lw: str, denominator: str) -> Callable[[dict[str, Any]], float]:
    return lambda x: x["loads"][lw]["bytes_fetched"] / x["loads"][lw][denominator]


def _load_field(lw: str, k: str) -> Callable[[dict[str, Any]], float]:
    return lambda x: x["loads"][lw][k]  # type: ignore[no-any-return]


def targets(records: list[Record]) -> list[Target]:
    rows = save_rows(records)
    out: list[Target] = []
    part_size = int(next((r["part_size"] for r in records if r.get("part_size")), 16 * MiB))

    def add(name: str, measured: str, ratio: float | None, goal: str,
            ok: Callable[[float], bool]) -> None:
        out.append(Target(name, measured, ratio, goal, None if ratio is None else ok(ratio)))

    vol_d = _find(rows, "direct", DEFAULT_VOL)
    ceil_d = ceiling(rows, "direct", "save")
    if vol_d and ceil_d and vol_d.save_s and ceil_d.save_s:
        add("direct: save time ÷ fastest raw upload",
            f"{vol_d.save_s.med:.2f}s vs {ceil_d.contender} {ceil_d.save_s.med:.2f}s",
            _ratio(vol_d.save_s, ceil_d.save_s), "≤ 1.05", lambda x: x <= 1.05)
    vol_s = _find(rows, "s3-like", DEFAULT_VOL)
    if vol_s and vol_s.save_mibs:
        ceil_s = ceiling(rows, "s3-like", "save")
        if ceil_s:
            add("s3-like: save throughput ÷ raw ceiling",
                f"{vol_s.save_mibs.med:.1f} vs {ceil_s.contender} {ceil_s.save_mibs.med:.1f} MiB/s",  # type: ignore[union-attr]
                _ratio(vol_s.save_mibs, ceil_s.save_mibs), "≥ 0.9", lambda x: x >= 0.9)
        for ref, goal, thr in (("fsspec-t1", "≥ 3", 3.0), ("s3tc-t8", "≥ 1.2", 1.2)):
            other = _find(rows, "s3-like", ref)
            if other and other.save_mibs:
                add(f"s3-like: save throughput ÷ {ref}",
                    f"{vol_s.save_mibs.med:.1f} vs {other.save_mibs.med:.1f} MiB/s",
                    _ratio(vol_s.save_mibs, other.save_mibs), goal,
                    lambda x, t=thr: x >= t)  # type: ignore[misc]
    for (profile,), rs in _group(records, "async", key=lambda r: (r["profile"],)).items():
        block = _res(rs, lambda x: x["async_block_s"])
        floor = _res(rs, lambda x: x["copy_prealloc_s"])
        if block and floor:
            add(f"{profile}: async_save blocking ÷ preallocated-copy floor",
                f"{block.med * 1e3:.0f} ms vs {floor.med * 1e3:.0f} ms",
                _ratio(block, floor), "≤ 1.2", lambda x: x <= 1.2)
    for profile in ("direct", "s3-like"):
        v, s = _find(rows, profile, DEFAULT_VOL), _find(rows, profile, "s3tc-t8")
        if v and s and v.load_s and s.load_s:
            add(f"{profile}: load time ÷ s3tc-t8 load time",
                f"{v.load_s.med:.2f}s vs {s.load_s.med:.2f}s", _ratio(v.load_s, s.load_s),
                "≤ 1.0", lambda x: x <= 1.0)
    for (profile,), rs in _group(records, "reshard", key=lambda r: (r["profile"],)).items():
        for lw in sorted({w for r in rs for w in r["result"]["loads"]}):
            reader = _res(rs, _load_ratio(lw, "bytes_needed"))
            logical = _res(rs, _load_ratio(lw, "logical_bytes_needed"))
            if logical:
                add(f"{profile}: 2→{lw} ranks bytes fetched ÷ bytes the new shards need",
                    f"reader's own figure (÷ stored items needed): {_fx(_med(reader))}",
                    logical.med, "≤ 1.1", lambda x: x <= 1.1)
    for r in rows:
        conc = None
        if r.contender.startswith("vol-"):
            conc = _parse_conc(r.contender) or TransferOptions().max_concurrency
        if conc and r.rss:
            budget = conc * part_size / MiB + 64
            add(f"{r.profile}: {r.contender} peak RSS above baseline during save ÷ budget",
                f"{r.rss.med:.0f} MiB vs {budget:.0f} MiB ({conc} × part + 64 MiB)",
                r.rss.med / budget, "≤ 1.0", lambda x: x <= 1.0)
    return out


# -------------------------------------------------------------------------------------------
# markdown


def _meta(records: list[Record]) -> Record:
    return records[0] if records else {}


def render_markdown(records: list[Record]) -> str:
    meta = _meta(records)
    rows = save_rows(records)
    sizes: dict[str, int] = {}
    for r in records:
        sizes.setdefault(r.get("profile", "?"), r.get("size_bytes", 0))
    size_text = ", ".join(f"{p} {n / MiB:.0f} MiB" for p, n in sizes.items())
    lines: list[str] = []
    add = lines.append
    add(f"# dcp_volumes benchmark — state dict {size_text}\n")
    if meta:
        v, m = meta.get("versions", {}), meta.get("machine", {})
        prof = (meta.get("network_profiles") or {}).get("s3-like") or {}
        reps = max((r.get("rep", 0) for r in records), default=0) + 1
        add(f"- command: `{meta.get('command')}`")
        add(f"- run: {meta.get('run_id')} — {reps} repetition(s), contenders interleaved; "
            f"server: {meta.get('server', '?')}")
        add(f"- machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model', '?')}), "
            f"{m.get('ram_gib')} GiB RAM, {m.get('platform')}")
        add("- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
        src = meta.get("source") or {}
        if src:
            bits = [f"git {src['git_commit']}" + (" + local changes" if src.get("git_dirty")
                                                  else "")] if src.get("git_commit") else []
            if src.get("note"):
                bits.append(src["note"])
            add("- dcp_volumes measured: " + ("; ".join(bits) or src.get("path", "?")))
        if prof:
            add(f"- profiles: `direct` = straight to the server; `s3-like` = through FaultProxy "
                f"(+{prof.get('first_byte_delay_s', 0) * 1e3:.0f} ms first byte per response, "
                f"{(prof.get('per_connection_bytes_per_s') or 0) / 1e6:.0f} MB/s per connection "
                f"each way)")
        add(f"- part size {meta.get('part_size', 0) / MiB:.0f} MiB; medians with (min–max); "
            "ratios are throughput ratios (> 1 = faster than the reference)")
    add("")
    errors = [r for r in records if "error" in r]
    for profile in [p for p in ("direct", "s3-like") if any(r.profile == p for r in rows)]:
        csave, cload = ceiling(rows, profile, "save"), ceiling(rows, profile, "load")
        base = _find(rows, profile, "fsspec-t1")
        add(f"## Save and load — `{profile}` ({sizes.get(profile, 0) / MiB:.0f} MiB state "
            "dict, world size 1)\n")
        if csave:
            add(f"Raw ceiling: upload {csave.contender} {_fx(_med(csave.save_mibs), 1)} MiB/s, "
                f"download {cload.contender if cload else '—'} "
                f"{_fx(_med(cload.load_mibs) if cload else None, 1)} MiB/s.\n")
        add("| contender | save s | save MiB/s | ×ceiling | ×fsspec-t1 | spool / tail / commit s "
            "| peak RSS +MiB | save CPU s | load s | load MiB/s | ×ceiling | ×s3tc | ×fsspec-t1 |")
        add("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        s3tc = _find(rows, profile, "s3tc-t8")
        for row in (x for x in rows if x.profile == profile):
            split = "—"
            if row.spool_s:
                split = (f"{row.spool_s.med:.2f} / {_fx(_med(row.upload_tail_s))}"
                         f" / {_fx(_med(row.commit_s))}")
            add("| " + " | ".join([
                f"`{row.contender}`",
                _fmt(row.save_s, 2),
                _fmt(row.save_mibs, 1),
                _fx(_ratio(row.save_mibs, csave.save_mibs if csave else None)),
                _fx(_ratio(row.save_mibs, base.save_mibs if base else None)),
                split,
                _fmt(row.rss, 0),
                _fmt(row.save_cpu_s, 1),
                _fmt(row.load_s, 2),
                _fmt(row.load_mibs, 1),
                _fx(_ratio(row.load_mibs, cload.load_mibs if cload else None)),
                _fx(_ratio(row.load_mibs, s3tc.load_mibs if s3tc else None)),
                _fx(_ratio(row.load_mibs, base.load_mibs if base else None)),
            ]) + " |")
        add("")
    asyncs = _group(records, "async", key=lambda r: (r["profile"],))
    if asyncs:
        add("## async_save (VolumeWriter as its own stager; 2nd save on the same writer)\n")
        add("| profile | blocking s | ÷ prealloc copy floor | prealloc copy floor s | clone floor s "
            "| 1st async_save blocking s | upload done s | torch DefaultStager blocking s |")
        add("|---|---|---|---|---|---|---|---|")
        for (profile,), rs in sorted(asyncs.items()):
            block = _res(rs, lambda x: x["async_block_s"])
            floor = _res(rs, lambda x: x["copy_prealloc_s"])
            add("| " + " | ".join([
                profile, block.fmt(3) if block else "—", _fx(_ratio(block, floor)),
                floor.fmt(3) if floor else "—",
                _fmt(_res(rs, lambda x: x["copy_clone_s"]), 3),
                _fmt(_res(rs, lambda x: x["async_first_block_s"]), 3),
                _fmt(_res(rs, lambda x: x["async_done_s"]), 2),
                _fmt(_res(rs, lambda x: x.get("torch_stager_block_s")), 3),
            ]) + " |")
        add("")
    reshards = _group(records, "reshard", key=lambda r: (r["profile"],))
    if reshards:
        add("## Resharded loads (saved sharded on 2 ranks, DTensor Shard(0))\n")
        add("| profile | load on | load s | logical bytes needed MiB | stored items needed MiB "
            "| fetched MiB | fetched ÷ logical | fetched ÷ stored items | ranges |")
        add("|---|---|---|---|---|---|---|---|---|")
        for (profile,), rs in sorted(reshards.items()):
            for lw in sorted({w for r in rs for w in r["result"]["loads"]}):
                fetched = _res(rs, _load_field(lw, "bytes_fetched"))
                logical = _res(rs, _load_field(lw, "logical_bytes_needed"))
                needed = _res(rs, _load_field(lw, "bytes_needed"))
                add("| " + " | ".join([
                    profile, f"{lw} rank(s)", _fmt(_res(rs, _load_field(lw, "load_s")), 2),
                    _fx(_med(logical, 1 / MiB), 1), _fx(_med(needed, 1 / MiB), 1),
                    _fx(_med(fetched, 1 / MiB), 1), _fx(_ratio(fetched, logical)),
                    _fx(_ratio(fetched, needed)),
                    _fx(_med(_res(rs, _load_field(lw, "ranges"))), 0),
                ]) + " |")
        add("")
    scal = _group(records, "scaling", key=lambda r: (r["profile"], r["layout"], r["world"]))
    if scal:
        add(f"## Scaling with ranks (gloo, total size fixed, `{DEFAULT_VOL}`)\n")
        add("| profile | state | ranks | save s | save MiB/s | load s | load MiB/s (state) "
            "| fetched MiB/s (all ranks) | peak RSS +MiB (max rank) |")
        add("|---|---|---|---|---|---|---|---|---|")
        for (profile, layout, world), rs in sorted(scal.items()):
            add("| " + " | ".join([
                profile, layout, str(world), _fmt(_res(rs, lambda x: x["save_s"]), 2),
                _fmt(_res(rs, _mibs("save_s")), 1), _fmt(_res(rs, lambda x: x["load_s"]), 2),
                _fmt(_res(rs, _mibs("load_s")), 1),
                _fmt(_res(rs, lambda x: x["bytes_fetched"] / MiB / x["load_s"]), 1),
                _fmt(_res(rs, lambda x: x["save_rss_peak_mib"]), 0),
            ]) + " |")
        add("")
    tg = targets(records)
    if tg:
        add(f"## Targets for dcp_volumes (`{DEFAULT_VOL}` = defaults unless named)\n")
        add("| target | measured (medians) | ratio | goal | verdict |")
        add("|---|---|---|---|---|")
        for t in tg:
            verdict = "—" if t.passed is None else ("met" if t.passed else "**missed**")
            add(f"| {t.name} | {t.measured} | {_fx(t.ratio)} | {t.goal} | {verdict} |")
        add("")
    bad = [r for r in _ok(records) if r["result"].get("ok") is False]
    if errors or bad:
        add("## Failures\n")
        for r in errors:
            add(f"- {r['kind']} `{r['contender']}` {r['profile']} rep {r.get('rep')}: "
                f"{r['error'].splitlines()[0][:300]}")
        for r in bad:
            add(f"- {r['kind']} `{r['contender']}` {r['profile']} rep {r.get('rep')}: "
                "loaded bytes differ from the saved ones")
        add("")
    return "\n".join(lines)


def _fmt(s: Stat | None, digits: int) -> str:
    return s.fmt(digits) if s else "—"


# -------------------------------------------------------------------------------------------
# plots


def write_plots(records: list[Record], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    rows = save_rows(records)
    profiles = [p for p in ("direct", "s3-like") if any(r.profile == p for r in rows)]
    if rows:
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
        fig.tight_layout()
        written.append(_save(fig, out_dir / "throughput.png"))
        plt.close(fig)
    asyncs = _group(records, "async", key=lambda r: (r["profile"],))
    if asyncs:
        fig, ax = plt.subplots(figsize=(8, 3.6))
        labels, vals, errs = [], [], []
        shown = ("direct",) if ("direct",) in asyncs else next(iter(asyncs))
        direct = asyncs[shown]
        for label, fn in (("copy into prealloc\n(floor)", lambda x: x["copy_prealloc_s"]),
                          ("fresh clone\n(floor)", lambda x: x["copy_clone_s"]),
                          ("VolumeWriter\nasync_save #2", lambda x: x["async_block_s"]),
                          ("VolumeWriter\nasync_save #1", lambda x: x["async_first_block_s"]),
                          ("torch DefaultStager\n(FsspecWriter)",
                           lambda x: x.get("torch_stager_block_s"))):
            s = _res(direct, fn)
            if s:
                labels.append(label)
                vals.append(s.med * 1e3)
                errs.append((s.med * 1e3 - s.lo * 1e3, s.hi * 1e3 - s.med * 1e3))
        ax.bar(range(len(vals)), vals, yerr=list(zip(*errs)) if errs else None, capsize=3,
               color=["tab:gray", "tab:gray", "tab:green", "tab:olive", "tab:red"][:len(vals)])
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("ms until control returns")
        ax.set_title(f"async_save blocking time vs the memory-copy floor ({shown[0]}; "
                     "median, min–max)")
        fig.tight_layout()
        written.append(_save(fig, out_dir / "async_blocking.png"))
        plt.close(fig)
    scal = _group(records, "scaling", key=lambda r: (r["profile"], r["layout"]))
    if scal:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for (profile, layout), recs in sorted(scal.items()):
            worlds = sorted({r["world"] for r in recs})
            for ax, field in zip(axes, ("save_s", "load_s")):
                meds = []
                for w in worlds:
                    st = _res([r for r in recs if r["world"] == w], _mibs(field))
                    meds.append(st.med if st else 0)
                ax.plot(worlds, meds, marker="o", label=f"{layout} ({profile})")
        for ax, what in zip(axes, ("save", "load")):
            ax.set_ylim(bottom=0)
            ax.set_xticks(sorted({r["world"] for rs in scal.values() for r in rs}))
            ax.set_xlabel("ranks (gloo, one host)")
            ax.set_ylabel("MiB/s of state (median)")
            ax.set_title(f"{what}: scaling with ranks, total size fixed")
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "scaling.png"))
        plt.close(fig)
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    return path


def write_report(records: list[Record], out_dir: Path, *, plots: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(render_markdown(records))
    if plots:
        try:
            write_plots(records, out_dir)
        except ImportError:
            pass  # matplotlib missing: the table is the report
