"""Turn ``dcp-volumes bench`` JSON lines into a markdown report, target verdicts and plots.

Ratios are throughput ratios (``contender MiB/s ÷ reference MiB/s``), so above 1 is faster,
except where a row says otherwise (time or byte ratios, where below 1 is better).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp_volumes.bench.aggregate import (
    MiB,
    Record,
    Row,
    ceiling,
    find_row,
    fmt_stat,
    fx,
    group,
    med_of,
    mibs,
    ok_records,
    ratio_of,
    read_jsonl,
    save_rows,
    stat_of,
)
from dcp_volumes.config import TransferOptions

__all__ = ["read_jsonl", "render_markdown", "targets", "write_report"]

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


def _target(name: str, measured: str, ratio: float | None, goal: str,
            ok: Callable[[float], bool]) -> Target:
    return Target(name, measured, ratio, goal, None if ratio is None else ok(ratio))


def targets(records: list[Record]) -> list[Target]:
    rows = save_rows(records)
    part_size = int(next((r["part_size"] for r in records if r.get("part_size")), 16 * MiB))
    return [*_save_targets(rows), *_async_targets(records), *_load_targets(rows),
            *_reshard_targets(records), *_rss_targets(rows, part_size)]


def _save_targets(rows: list[Row]) -> list[Target]:
    out: list[Target] = []
    vol_d = find_row(rows, "direct", DEFAULT_VOL)
    ceil_d = ceiling(rows, "direct", "save")
    if vol_d and ceil_d and vol_d.save_s and ceil_d.save_s:
        out.append(_target(
            "direct: save time ÷ fastest raw upload",
            f"{vol_d.save_s.med:.2f}s vs {ceil_d.contender} {ceil_d.save_s.med:.2f}s",
            ratio_of(vol_d.save_s, ceil_d.save_s), "≤ 1.05", lambda x: x <= 1.05))
    vol_s = find_row(rows, "s3-like", DEFAULT_VOL)
    if vol_s and vol_s.save_mibs:
        ceil_s = ceiling(rows, "s3-like", "save")
        if ceil_s:
            out.append(_target(
                "s3-like: save throughput ÷ raw ceiling",
                f"{vol_s.save_mibs.med:.1f} vs {ceil_s.contender} {ceil_s.save_mibs.med:.1f} MiB/s",  # type: ignore[union-attr]
                ratio_of(vol_s.save_mibs, ceil_s.save_mibs), "≥ 0.9", lambda x: x >= 0.9))
        for ref, goal, thr in (("fsspec-t1", "≥ 3", 3.0), ("s3tc-t8", "≥ 1.2", 1.2)):
            other = find_row(rows, "s3-like", ref)
            if other and other.save_mibs:
                out.append(_target(
                    f"s3-like: save throughput ÷ {ref}",
                    f"{vol_s.save_mibs.med:.1f} vs {other.save_mibs.med:.1f} MiB/s",
                    ratio_of(vol_s.save_mibs, other.save_mibs), goal,
                    lambda x, t=thr: x >= t))  # type: ignore[misc]
    return out


def _async_targets(records: list[Record]) -> list[Target]:
    out: list[Target] = []
    for (profile,), rs in group(records, "async", key=lambda r: (r["profile"],)).items():
        floor = stat_of(rs, lambda x: x["copy_prealloc_s"])
        for pattern, field in (("", "async_block_s"), (" (fresh writer per step)",
                                                       "async_fresh_block_s")):
            block = stat_of(rs, lambda x, f=field: x.get(f))  # type: ignore[misc]
            if block and floor:
                out.append(_target(
                    f"{profile}: async_save blocking{pattern} ÷ preallocated-copy floor",
                    f"{block.med * 1e3:.0f} ms vs {floor.med * 1e3:.0f} ms",
                    ratio_of(block, floor), "≤ 1.2", lambda x: x <= 1.2))
    return out


def _load_targets(rows: list[Row]) -> list[Target]:
    out: list[Target] = []
    for profile in ("direct", "s3-like"):
        v, s = find_row(rows, profile, DEFAULT_VOL), find_row(rows, profile, "s3tc-t8")
        if v and s and v.load_s and s.load_s:
            out.append(_target(
                f"{profile}: load time ÷ s3tc-t8 load time",
                f"{v.load_s.med:.2f}s vs {s.load_s.med:.2f}s", ratio_of(v.load_s, s.load_s),
                "≤ 1.0", lambda x: x <= 1.0))
    return out


def _reshard_targets(records: list[Record]) -> list[Target]:
    out: list[Target] = []
    for (profile,), rs in group(records, "reshard", key=lambda r: (r["profile"],)).items():
        for lw in sorted({w for r in rs for w in r["result"]["loads"]}):
            reader = stat_of(rs, _load_ratio(lw, "bytes_needed"))
            logical = stat_of(rs, _load_ratio(lw, "logical_bytes_needed"))
            if logical:
                out.append(_target(
                    f"{profile}: 2→{lw} ranks bytes fetched ÷ bytes the new shards need",
                    f"reader's own figure (÷ stored items needed): {fx(med_of(reader))}",
                    logical.med, "≤ 1.1", lambda x: x <= 1.1))
    return out


def _rss_targets(rows: list[Row], part_size: int) -> list[Target]:
    out: list[Target] = []
    for r in rows:
        conc = None
        if r.contender.startswith("vol-"):
            conc = _parse_conc(r.contender) or TransferOptions().max_concurrency
        if conc and r.rss:
            budget = conc * part_size / MiB + 64
            out.append(_target(
                f"{r.profile}: {r.contender} peak RSS above baseline during save ÷ budget",
                f"{r.rss.med:.0f} MiB vs {budget:.0f} MiB ({conc} × part + 64 MiB)",
                r.rss.med / budget, "≤ 1.0", lambda x: x <= 1.0))
    return out


# -------------------------------------------------------------------------------------------
# markdown


def render_markdown(records: list[Record]) -> str:
    rows = save_rows(records)
    sizes: dict[str, int] = {}
    for r in records:
        sizes.setdefault(r.get("profile", "?"), r.get("size_bytes", 0))
    size_text = ", ".join(f"{p} {n / MiB:.0f} MiB" for p, n in sizes.items())
    lines = [f"# dcp_volumes benchmark — state dict {size_text}\n"]
    lines += _md_context(records)
    lines.append("")
    for profile in [p for p in ("direct", "s3-like") if any(r.profile == p for r in rows)]:
        lines += _md_save_load(rows, profile, sizes.get(profile, 0))
    lines += _md_async(records)
    lines += _md_reshard(records)
    lines += _md_scaling(records)
    lines += _md_targets(records)
    lines += _md_failures(records)
    return "\n".join(lines)


def _md_context(records: list[Record]) -> list[str]:
    """What produced the results: command, run, machine, versions, code, profiles."""
    meta = records[0] if records else {}
    if not meta:
        return []
    v, m = meta.get("versions", {}), meta.get("machine", {})
    prof = (meta.get("network_profiles") or {}).get("s3-like") or {}
    reps = max((r.get("rep", 0) for r in records), default=0) + 1
    lines = [
        f"- command: `{meta.get('command')}`",
        (f"- run: {meta.get('run_id')} — {reps} repetition(s), contenders interleaved; "
         f"server: {meta.get('server', '?')}"),
        (f"- machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model', '?')}), "
         f"{m.get('ram_gib')} GiB RAM, {m.get('platform')}"),
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
    ]
    src = meta.get("source") or {}
    if src:
        bits = [f"git {src['git_commit']}" + (" + local changes" if src.get("git_dirty")
                                              else "")] if src.get("git_commit") else []
        if src.get("note"):
            bits.append(src["note"])
        lines.append("- dcp_volumes measured: " + ("; ".join(bits) or src.get("path", "?")))
    if prof:
        lines.append(
            f"- profiles: `direct` = straight to the server; `s3-like` = through FaultProxy "
            f"(+{prof.get('first_byte_delay_s', 0) * 1e3:.0f} ms first byte per response, "
            f"{(prof.get('per_connection_bytes_per_s') or 0) / 1e6:.0f} MB/s per connection "
            f"each way)")
    lines.append(f"- part size {meta.get('part_size', 0) / MiB:.0f} MiB; medians with (min–max); "
                 "ratios are throughput ratios (> 1 = faster than the reference)")
    return lines


def _md_save_load(rows: list[Row], profile: str, size: int) -> list[str]:
    csave, cload = ceiling(rows, profile, "save"), ceiling(rows, profile, "load")
    base = find_row(rows, profile, "fsspec-t1")
    s3tc = find_row(rows, profile, "s3tc-t8")
    lines = [f"## Save and load — `{profile}` ({size / MiB:.0f} MiB state dict, world size 1)\n"]
    if csave:
        lines.append(
            f"Raw ceiling: upload {csave.contender} {fx(med_of(csave.save_mibs), 1)} MiB/s, "
            f"download {cload.contender if cload else '—'} "
            f"{fx(med_of(cload.load_mibs) if cload else None, 1)} MiB/s.\n")
    lines.append("| contender | save s | save MiB/s | ×ceiling | ×fsspec-t1 "
                 "| spool / tail / commit s | peak RSS +MiB | save CPU s | load s | load MiB/s "
                 "| ×ceiling | ×s3tc | ×fsspec-t1 |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in (x for x in rows if x.profile == profile):
        split = "—"
        if row.spool_s:
            split = (f"{row.spool_s.med:.2f} / {fx(med_of(row.upload_tail_s))}"
                     f" / {fx(med_of(row.commit_s))}")
        lines.append("| " + " | ".join([
            f"`{row.contender}`",
            fmt_stat(row.save_s, 2),
            fmt_stat(row.save_mibs, 1),
            fx(ratio_of(row.save_mibs, csave.save_mibs if csave else None)),
            fx(ratio_of(row.save_mibs, base.save_mibs if base else None)),
            split,
            fmt_stat(row.rss, 0),
            fmt_stat(row.save_cpu_s, 1),
            fmt_stat(row.load_s, 2),
            fmt_stat(row.load_mibs, 1),
            fx(ratio_of(row.load_mibs, cload.load_mibs if cload else None)),
            fx(ratio_of(row.load_mibs, s3tc.load_mibs if s3tc else None)),
            fx(ratio_of(row.load_mibs, base.load_mibs if base else None)),
        ]) + " |")
    lines.append("")
    return lines


def _md_async(records: list[Record]) -> list[str]:
    asyncs = group(records, "async", key=lambda r: (r["profile"],))
    if not asyncs:
        return []
    lines = [
        "## async_save (VolumeWriter as its own stager; saves after the first)\n",
        ("| profile | blocking s, one writer kept | ÷ prealloc copy floor "
         "| blocking s, fresh writer per step | ÷ prealloc copy floor "
         "| prealloc copy floor s | clone floor s "
         "| 1st async_save blocking s | upload done s | torch DefaultStager blocking s |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (profile,), rs in sorted(asyncs.items()):
        block = stat_of(rs, lambda x: x["async_block_s"])
        fresh = stat_of(rs, lambda x: x.get("async_fresh_block_s"))
        floor = stat_of(rs, lambda x: x["copy_prealloc_s"])
        lines.append("| " + " | ".join([
            profile, block.fmt(3) if block else "—", fx(ratio_of(block, floor)),
            fresh.fmt(3) if fresh else "—", fx(ratio_of(fresh, floor)),
            floor.fmt(3) if floor else "—",
            fmt_stat(stat_of(rs, lambda x: x["copy_clone_s"]), 3),
            fmt_stat(stat_of(rs, lambda x: x["async_first_block_s"]), 3),
            fmt_stat(stat_of(rs, lambda x: x["async_done_s"]), 2),
            fmt_stat(stat_of(rs, lambda x: x.get("torch_stager_block_s")), 3),
        ]) + " |")
    lines.append("")
    return lines


def _md_reshard(records: list[Record]) -> list[str]:
    reshards = group(records, "reshard", key=lambda r: (r["profile"],))
    if not reshards:
        return []
    lines = [
        "## Resharded loads (saved sharded on 2 ranks, DTensor Shard(0))\n",
        ("| profile | load on | load s | logical bytes needed MiB | stored items needed MiB "
         "| fetched MiB | fetched ÷ logical | fetched ÷ stored items | ranges |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (profile,), rs in sorted(reshards.items()):
        for lw in sorted({w for r in rs for w in r["result"]["loads"]}):
            fetched = stat_of(rs, _load_field(lw, "bytes_fetched"))
            logical = stat_of(rs, _load_field(lw, "logical_bytes_needed"))
            needed = stat_of(rs, _load_field(lw, "bytes_needed"))
            lines.append("| " + " | ".join([
                profile, f"{lw} rank(s)", fmt_stat(stat_of(rs, _load_field(lw, "load_s")), 2),
                fx(med_of(logical, 1 / MiB), 1), fx(med_of(needed, 1 / MiB), 1),
                fx(med_of(fetched, 1 / MiB), 1), fx(ratio_of(fetched, logical)),
                fx(ratio_of(fetched, needed)),
                fx(med_of(stat_of(rs, _load_field(lw, "ranges"))), 0),
            ]) + " |")
    lines.append("")
    return lines


def _md_scaling(records: list[Record]) -> list[str]:
    scal = group(records, "scaling", key=lambda r: (r["profile"], r["layout"], r["world"]))
    if not scal:
        return []
    lines = [
        f"## Scaling with ranks (gloo, total size fixed, `{DEFAULT_VOL}`)\n",
        ("| profile | state | ranks | save s | save MiB/s | load s | load MiB/s (state) "
         "| fetched MiB/s (all ranks) | peak RSS +MiB (max rank) |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (profile, layout, world), rs in sorted(scal.items()):
        lines.append("| " + " | ".join([
            profile, layout, str(world), fmt_stat(stat_of(rs, lambda x: x["save_s"]), 2),
            fmt_stat(stat_of(rs, mibs("save_s")), 1),
            fmt_stat(stat_of(rs, lambda x: x["load_s"]), 2),
            fmt_stat(stat_of(rs, mibs("load_s")), 1),
            fmt_stat(stat_of(rs, lambda x: x["bytes_fetched"] / MiB / x["load_s"]), 1),
            fmt_stat(stat_of(rs, lambda x: x["save_rss_peak_mib"]), 0),
        ]) + " |")
    lines.append("")
    return lines


def _md_targets(records: list[Record]) -> list[str]:
    tg = targets(records)
    if not tg:
        return []
    lines = [
        f"## Targets for dcp_volumes (`{DEFAULT_VOL}` = defaults unless named)\n",
        "| target | measured (medians) | ratio | goal | verdict |",
        "|---|---|---|---|---|",
    ]
    for t in tg:
        verdict = "—" if t.passed is None else ("met" if t.passed else "**missed**")
        lines.append(f"| {t.name} | {t.measured} | {fx(t.ratio)} | {t.goal} | {verdict} |")
    lines.append("")
    return lines


def _md_failures(records: list[Record]) -> list[str]:
    errors = [r for r in records if "error" in r]
    bad = [r for r in ok_records(records) if r["result"].get("ok") is False]
    if not (errors or bad):
        return []
    lines = ["## Failures\n"]
    for r in errors:
        lines.append(f"- {r['kind']} `{r['contender']}` {r['profile']} rep {r.get('rep')}: "
                     f"{r['error'].splitlines()[0][:300]}")
    for r in bad:
        lines.append(f"- {r['kind']} `{r['contender']}` {r['profile']} rep {r.get('rep')}: "
                     "loaded bytes differ from the saved ones")
    lines.append("")
    return lines


def write_report(records: list[Record], out_dir: Path, *, plots: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(render_markdown(records))
    if plots:
        try:
            from dcp_volumes.bench.plots import write_plots

            write_plots(records, out_dir)
        except ImportError:
            pass  # matplotlib missing: the table is the report
