"""The ``dcp-volumes bench`` harness: arguments, the plan of measurements, and the run.

Every contender saves (and then loads) the same state dict on the same server, under the
same network profiles, interleaved (A B C A B C ...) for ``--reps`` repetitions. Each
measurement runs in a fresh worker process (``python -m dcp_volumes.bench.worker``); its
result becomes one JSON line in ``results.jsonl``, and :mod:`dcp_volumes.bench.report` turns
the lines into ``results.md`` and plots. The contenders and profiles are described in
:mod:`dcp_volumes.bench`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dcp_volumes.bench.contenders import parse_contender
from dcp_volumes.bench.facts import command, machine, source, versions
from dcp_volumes.bench.runner import run_worker
from dcp_volumes.bench.state import layout_for, state_bytes, write_pool
from dcp_volumes.bench.target import Target, open_target

__all__ = [
    "DEFAULT_CONTENDERS",
    "SMOKE",
    "add_arguments",
    "build_parser",
    "main",
    "parse_size",
    "plan",
    "run",
]

logger = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30

DEFAULT_CONTENDERS = (
    "vol-disk", "vol-memory", "vol-disk-c8",
    "fsspec-t1", "fsspec-t8", "s3tc-t8", "local-fs",
    "raw-obstore-c2", "raw-obstore-c4", "raw-obstore", "raw-obstore-c16", "raw-boto3",
)
DEFAULT_KINDS = ("save", "async", "reshard", "scaling")
PROFILES = ("direct", "s3-like")
#: The --smoke preset: tiny, one repetition, few contenders, direct profile only.
SMOKE = {
    "size": 8 * MiB, "reps": 1, "profiles": ("direct",),
    "contenders": ("vol-disk", "fsspec-t1", "local-fs", "raw-s3fs"),
    "kinds": ("save", "async", "reshard"),
}
# Contenders that only speak S3.
_S3_ONLY = ("s3tc", "raw-obstore", "raw-boto3")
#: how many times a job writes its state's bytes (save + load; async also stages a copy)
_WRITES_PER_JOB = {"async": 5}


# -------------------------------------------------------------------------------------------
# arguments


def parse_size(text: str) -> int:
    """``64MiB``, ``1GiB``, ``512M`` (binary units), ``10MB`` (decimal), or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 64MiB or 1GiB, got {text!r}")
    value, unit, binary, b = m.groups()
    power = " KMGT".index(unit.upper()) if unit else 0
    base = 1024 if (binary or (unit and not b)) else 1000
    return int(float(value) * base**power)


def _rate(text: str) -> float:
    """Bytes per second: ``10MB`` (= 10e6), ``8MiB``, ``0`` for no cap."""
    text = text.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    return float(parse_size(text))


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``bench`` options on ``parser`` (used by ``dcp-volumes bench``)."""
    _add_what(parser.add_argument_group("what to measure"))
    _add_where(parser.add_argument_group("where"))
    _add_output(parser.add_argument_group("output"))


def _add_what(g: Any) -> None:
    g.add_argument("--size", type=parse_size, default=GiB,
                   help="state dict size, e.g. 64MiB, 512MiB, 1GiB (default 1GiB)")
    g.add_argument("--s3-like-size", type=parse_size, default=None, metavar="SIZE",
                   help="state dict size under the s3-like profile (default: --size); at "
                        "10 MB/s per connection the slow contenders take minutes per GiB")
    g.add_argument("--reps", type=int, default=3, help="repetitions per measurement (default 3)")
    g.add_argument("--smoke", action="store_true",
                   help="tiny run for CI: 8 MiB, 1 repetition, few contenders, direct only")
    g.add_argument("--contenders", type=_csv, default=DEFAULT_CONTENDERS,
                   help="comma-separated contenders; NAME:save measures the save only "
                        "(default: all of "
                        f"{','.join(DEFAULT_CONTENDERS)})")
    g.add_argument("--s3-like-contenders", type=_csv, default=None,
                   help="contenders under the s3-like profile (default: --contenders)")
    g.add_argument("--no-torch-stager", action="store_true",
                   help="skip the async_save comparison with torch's DefaultStager "
                        "(FsspecWriter t=8)")
    g.add_argument("--kinds", type=_csv, default=DEFAULT_KINDS,
                   help="comma-separated measurement kinds: save (save+load per contender, raw "
                        "clients), async, reshard, scaling (default: all)")
    g.add_argument("--profiles", type=_csv, default=PROFILES,
                   help="network profiles: direct, s3-like (default both)")
    g.add_argument("--scaling-profiles", type=_csv, default=("direct",),
                   help="profiles for the rank-scaling runs (default: direct)")
    g.add_argument("--reshard-profiles", type=_csv, default=("direct",),
                   help="profiles for the resharded-load runs (default: direct)")
    g.add_argument("--ranks", type=_csv, default=("1", "2", "4"),
                   help="world sizes for the scaling runs (default 1,2,4)")
    g.add_argument("--part-size", type=parse_size, default=16 * MiB,
                   help="part size for dcp_volumes and the raw clients (default 16MiB)")
    g.add_argument("--raw-concurrency", type=int, default=8,
                   help="requests in flight for raw clients named without -cN (default 8); "
                        "raw-obstore-c2 etc. set their own")


def _add_where(s: Any) -> None:
    s.add_argument("--server", default="seaweedfs",
                   choices=("seaweedfs", "moto", "fake-gcs", "azurite"),
                   help="local server the harness starts (default seaweedfs); ignored with "
                        "--endpoint-url")
    s.add_argument("--endpoint-url", metavar="URL",
                   help="use this existing endpoint instead of starting a server; credentials "
                        "come from the environment (AWS_*); needs --url")
    s.add_argument("--url", metavar="URL",
                   help="bucket and prefix to write under, e.g. s3://my-bucket/bench (with "
                        "--endpoint-url, or alone for real AWS S3)")
    s.add_argument("--first-byte-delay", type=float, default=0.030, metavar="SECONDS",
                   help="s3-like profile: delay added before every response (default 0.030)")
    s.add_argument("--bandwidth", type=_rate, default=10e6, metavar="BYTES_PER_S",
                   help="s3-like profile: cap per connection, each direction (default 10MB = "
                        "10e6 bytes/s)")
    s.add_argument("--spool-dir", metavar="DIR",
                   help="local directory for dcp_volumes' disk spool, the local-fs contender "
                        "and the data pool (default: the system temp dir)")


def _add_output(o: Any) -> None:
    o.add_argument("--out", default="benchmarks/results", metavar="DIR",
                   help="results directory: results.jsonl, results.md, *.png "
                        "(default benchmarks/results)")
    o.add_argument("--report-only", metavar="JSONL",
                   help="measure nothing: rebuild the table and plots from this JSON lines file")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="per measurement (default: 120 s + 1 s per 2 MB)")
    o.add_argument("--py-spy", metavar="DIR",
                   help="profiling mode: run every worker under `py-spy record` and write "
                        "collapsed stacks (DIR/<n>-<kind>-<contender>-<profile>.txt) for "
                        "flamegraphs; sampling perturbs the timings, so don't publish them")
    o.add_argument("--restart-every", type=parse_size, default=24 * GiB, metavar="SIZE",
                   help="restart the local server after this many bytes written, to keep its "
                        "disk use bounded (default 24GiB)")


# -------------------------------------------------------------------------------------------
# the plan


@dataclass
class _Job:
    kind: str  # save_load | raw | async | scaling | reshard
    contender: str
    profile: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        bits = [self.kind, self.contender, self.profile]
        bits += [f"{k}={v}" for k, v in sorted(self.extra.items()) if k == "world"]
        return " ".join(bits)


def _applies(contender: str, speaks_s3: bool) -> bool:
    return speaks_s3 or not contender.startswith(_S3_ONLY)


def plan(args: argparse.Namespace, speaks_s3: bool) -> tuple[list[_Job], list[str]]:
    """The measurements of one repetition, in the order they run; and what was skipped why."""
    jobs: list[_Job] = []
    skipped: list[str] = []
    by_profile = _contenders_by_profile(args)
    for profile in args.profiles:
        if "save" in args.kinds:
            jobs += _save_jobs(by_profile[profile], profile, speaks_s3, skipped)
        if "async" in args.kinds:
            jobs.append(_Job("async", "vol-disk", profile,
                             {"torch_default_stager": profile == "direct"
                              and not args.no_torch_stager}))
        if "reshard" in args.kinds and profile in args.reshard_profiles:
            jobs.append(_Job("reshard", "vol-disk", profile,
                             {"save_world": 2, "load_worlds": [1] if args.smoke else [1, 3]}))
    if "scaling" in args.kinds:
        for profile in args.scaling_profiles:
            if profile not in args.profiles:
                continue
            for world in args.ranks:
                jobs.append(_Job("scaling", "vol-disk", profile,
                                 {"world": int(world), "layouts": ["sharded", "replicated"]}))
    return jobs, skipped


def _contenders_by_profile(args: argparse.Namespace) -> dict[str, list[str]]:
    """The contender entries of each profile, validated before anything runs."""
    by_profile = {p: list(args.contenders) for p in args.profiles}
    if getattr(args, "s3_like_contenders", None) and "s3-like" in by_profile:
        by_profile["s3-like"] = list(args.s3_like_contenders)
    for c in {c for cs in by_profile.values() for c in cs}:
        parse_contender(c.split(":", 1)[0])  # validate early
        if ":" in c and c.split(":", 1)[1] != "save":
            raise ValueError(f"contender {c!r}: the only suffix is ':save' (skip the load)")
    return by_profile


def _save_jobs(entries: list[str], profile: str, speaks_s3: bool,
               skipped: list[str]) -> list[_Job]:
    jobs: list[_Job] = []
    for entry in entries:
        c, _, suffix = entry.partition(":")
        extra = {"save_only": True} if suffix == "save" else {}
        if not _applies(c, speaks_s3):
            skipped.append(f"{c}: needs an s3:// store")
            continue
        if c == "raw-s3fs" and not speaks_s3:
            c = "raw-fsspec"
        if c == "local-fs" and profile != "direct":
            continue  # no network in the way: measured once, under direct
        kind = "raw" if c.startswith("raw-") else "save_load"
        jobs.append(_Job(kind, c, profile, extra))
    return jobs


# -------------------------------------------------------------------------------------------
# running workers


def _batches(jobs: list[_Job], *, one_process: bool) -> list[list[_Job]]:
    """One worker process per measurement; ``one_process`` (smoke) shares one among the
    single-process jobs of a profile to save interpreter start-ups (RSS figures then mix)."""
    if not one_process:
        return [[j] for j in jobs]
    out: list[list[_Job]] = []
    for j in jobs:
        if (j.kind in ("save_load", "raw", "async") and out and out[-1][0].profile == j.profile
                and out[-1][0].kind in ("save_load", "raw", "async")):
            out[-1].append(j)
        else:
            out.append([j])
    return out


def _records(base: dict[str, Any], res: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON lines for one measurement (a scaling job gives one per state layout)."""
    if "error" in res:
        return [{**base, "error": res["error"], "traceback": res.get("traceback", "")}]
    result = res["result"]
    if "by_layout" in result:
        base = {k: v for k, v in base.items() if k != "layouts"}
        return [{**base, "layout": layout, "result": sub}
                for layout, sub in result["by_layout"].items()]
    return [{**base, "result": result}]


def _summary_line(job: _Job, res: dict[str, Any]) -> str:
    if "error" in res:
        return f"ERROR {res['error'].splitlines()[0][:160]}"
    r = res["result"]
    if "by_layout" in r:
        return "; ".join(f"{k}: {_summary_line(job, {'result': v})}"
                         for k, v in r["by_layout"].items())
    mib = r.get("bytes", 0) / MiB
    parts = []
    if "save_s" in r:
        parts.append(f"save {r['save_s']:.2f}s ({mib / r['save_s']:.0f} MiB/s)")
    if "load_s" in r:
        parts.append(f"load {r['load_s']:.2f}s ({mib / r['load_s']:.0f} MiB/s)")
    if "async_block_s" in r:
        fresh = r.get("async_fresh_block_s")
        parts.append(f"async block {r['async_block_s']:.3f}s kept writer"
                     + (f", {fresh:.3f}s fresh writer" if fresh is not None else "")
                     + f" (copy floor {r['copy_prealloc_s']:.3f}s), "
                     f"done {r['async_done_s']:.2f}s")
    if "loads" in r:
        for w, ld in r["loads"].items():
            parts.append(f"load@{w} {ld['load_s']:.2f}s fetched/needed "
                         f"{ld['bytes_fetched'] / max(1, ld['logical_bytes_needed']):.2f}")
    if "save_rss_peak_mib" in r:
        parts.append(f"rss +{r['save_rss_peak_mib']:.0f} MiB")
    if r.get("ok") is False:
        parts.append("MISMATCH")
    return ", ".join(parts)


# -------------------------------------------------------------------------------------------
# the run


@dataclass
class _Run:
    """One benchmark run: its settings, and what it has measured so far."""

    args: argparse.Namespace
    run_id: str
    sizes: dict[str, int]  # requested state dict size per profile
    nbytes: dict[str, int]  # the bytes that size lays out to
    timeout: float  # per measurement
    common: dict[str, Any]  # context written into every JSON line
    workdir: str = ""
    pool: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0
    done: int = 0  # measurements finished
    written: int = 0  # bytes written to the local server since its last restart


def _apply_smoke(args: argparse.Namespace) -> None:
    if args.smoke:
        args.size, args.reps = SMOKE["size"], SMOKE["reps"]
        args.profiles, args.contenders, args.kinds = (SMOKE["profiles"], SMOKE["contenders"],
                                                      SMOKE["kinds"])
    for p in args.profiles:
        if p not in PROFILES:
            raise ValueError(f"unknown profile {p!r}: choose from {', '.join(PROFILES)}")
    if args.reps < 1:
        raise ValueError("--reps must be >= 1")


def _new_run(args: argparse.Namespace) -> _Run:
    run_id = (_dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-"
              + secrets.token_hex(3))
    sizes = {p: (args.s3_like_size if p == "s3-like" and args.s3_like_size else args.size)
             for p in args.profiles}
    nbytes = {p: state_bytes(layout_for(size)) for p, size in sizes.items()}
    common = {
        "schema": 1, "run_id": run_id, "command": command(), "versions": versions(),
        "machine": machine(), "source": source(), "part_size": args.part_size,
        "network_profiles": {"direct": None, "s3-like": {
            "first_byte_delay_s": args.first_byte_delay,
            "per_connection_bytes_per_s": args.bandwidth}},
    }
    return _Run(args, run_id, sizes, nbytes, args.timeout or 120.0 + max(nbytes.values()) / 2e6,
                common)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); returns 0 on success,
    1 if any measurement failed or loaded wrong bytes."""
    from dcp_volumes.bench import report

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report.write_report(report.read_jsonl(args.report_only), out_dir,
                            plots=not args.no_plots)
        print(f"wrote {out_dir / 'results.md'}")
        return 0
    _apply_smoke(args)
    state = _new_run(args)
    jsonl = out_dir / "results.jsonl"
    state.workdir = tempfile.mkdtemp(prefix="dcpv-bench-", dir=args.spool_dir)
    started = time.monotonic()
    try:
        state.pool = os.path.join(state.workdir, "pool.bin")
        write_pool(state.pool, max(state.nbytes.values()))
        with open_target(args, state.run_id) as target, open(jsonl, "w") as sink:
            _measure_all(state, target, sink)
    finally:
        shutil.rmtree(state.workdir, ignore_errors=True)
    report.write_report(state.records, out_dir, plots=not args.no_plots)
    print(f"{len(state.records)} measurements in {time.monotonic() - started:.0f}s; wrote "
          f"{jsonl}, {out_dir / 'results.md'}" + ("" if args.no_plots else " and plots"))
    if state.failures:
        print(f"{state.failures} measurements failed or loaded wrong bytes (see results.jsonl)",
              file=sys.stderr)
    return 1 if state.failures else 0


def _measure_all(state: _Run, target: Target, sink: IO[str]) -> None:
    args = state.args
    jobs, skipped = plan(args, target.speaks_s3)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    total = len(jobs) * args.reps
    for rep in range(args.reps):
        for batch in _batches(jobs, one_process=args.smoke):
            if target.server is not None and state.written >= args.restart_every:
                target.restart()
                state.written = 0
            _measure_batch(state, target, batch, rep, sink, total)


def _measure_batch(state: _Run, target: Target, batch: list[_Job], rep: int, sink: IO[str],
                   total: int) -> None:
    """Run ``batch`` in one worker, write its JSON lines and a progress line per job."""
    args = state.args
    specs: list[dict[str, Any]] = []
    urls: list[str] = []
    for job in batch:
        url = (f"{target.base_url}/r{rep}-{state.done + len(specs) + 1:03d}-{job.kind}-"
               f"{job.contender}")
        urls.append(url)
        specs.append(_spec(state, target, job, url))
    t0 = time.monotonic()
    prof = None
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
        j = batch[0]
        prof = os.path.join(args.py_spy,
                            f"{state.done + 1:03d}-{j.kind}-{j.contender}-{j.profile}.txt")
    results = run_worker(specs, target.env(batch[0].profile),
                          state.timeout * 2 * len(specs), state.workdir, prof)
    elapsed = (time.monotonic() - t0) / len(specs)
    for url in urls:
        target.remove(url)
        target.remove(url + "-warmup")
    for job, res in zip(batch, results):
        state.done += 1
        state.written += state.nbytes[job.profile] * _WRITES_PER_JOB.get(job.kind, 2)
        _write_records(state, target, job, res, rep, elapsed, sink)
        print(f"[{state.done}/{total}] rep {rep + 1} {job.label}: "
              f"{_summary_line(job, res)} ({elapsed:.0f}s)", file=sys.stderr, flush=True)


def _spec(state: _Run, target: Target, job: _Job, url: str) -> dict[str, Any]:
    """What the worker needs for one measurement (no secrets: those travel in its env)."""
    args = state.args
    return {
        "kind": job.kind, "contender": job.contender, "profile": job.profile,
        "size": state.sizes[job.profile], "pool": state.pool, "url": url,
        "storage_options": target.storage_options(job.profile),
        "part_size": args.part_size, "spool_dir": args.spool_dir,
        "concurrency": args.raw_concurrency, "files": 2,
        "timeout": state.timeout, **job.extra,
    }


def _write_records(state: _Run, target: Target, job: _Job, res: dict[str, Any], rep: int,
                   elapsed: float, sink: IO[str]) -> None:
    base = {**state.common, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "kind": job.kind, "contender": job.contender,
            "profile": job.profile, "rep": rep,
            "size_bytes": state.nbytes[job.profile],
            "server": target.description, "wall_s": round(elapsed, 2),
            **job.extra}
    for record in _records(base, res):
        if "error" in record or record["result"].get("ok") is False:
            state.failures += 1
        state.records.append(record)
        sink.write(json.dumps(record) + "\n")
    sink.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dcp_volumes.bench",
        description="Benchmark dcp_volumes against torch FsspecWriter, s3torchconnector, the "
                    "local disk and raw object-store clients.")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"dcp_volumes.bench: error: {exc}", file=sys.stderr)
        return 2
