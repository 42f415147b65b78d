"""``dcp-volumes bench``: dcp_volumes next to what you would otherwise use, on one store.

Every contender saves (and then loads) the same state dict on the same server, under the
same network profiles, interleaved (A B C A B C ...) for ``--reps`` repetitions; the report
gives medians with min–max. Each measurement runs in a fresh worker process
(:mod:`dcp_volumes._bench_worker`) so peak RSS and warm connections are its own.

Contenders:

* ``vol-{disk,memory}``: :class:`~dcp_volumes.VolumeWriter` / ``VolumeReader`` with that
  spool mode and the default (adaptive) concurrency; ``vol-{disk,memory}-cN``: fixed at
  ``max_concurrency=N`` (``adaptive_concurrency=False``).
* ``fsspec-tN``: torch's ``FsspecWriter(sync_files=False, thread_count=N)`` / ``FsspecReader``.
* ``s3tc-t8``: s3torchconnector's ``S3StorageWriter(thread_count=8)`` / ``S3StorageReader``.
* ``local-fs``: torch's ``FileSystemWriter`` / ``FileSystemReader`` on a local directory (the
  local-disk reference; loads come from the page cache).
* ``raw-obstore``, ``raw-s3fs``, ``raw-boto3``: the same bytes uploaded and downloaded as
  plain objects, ``--raw-concurrency`` requests in flight (or N with a ``-cN`` suffix, e.g.
  ``raw-obstore-c4``); the fastest of all raw contenders is the *raw ceiling*.
* copy floors for ``dcp.async_save`` (copy into preallocated buffers; a fresh clone), measured
  in the async job next to VolumeWriter's own staging.

Network profiles: ``direct`` (straight to the server) and ``s3-like`` (through a
:class:`~dcp_volumes.testing.faultproxy.FaultProxy` in its own process adding
``--first-byte-delay`` per response and capping each connection at ``--bandwidth`` bytes/s
each way; defaults 30 ms and 10 MB/s).

Use it as ``python -m dcp_volumes.bench`` or, registered by the CLI, ``dcp-volumes bench``
(:func:`add_arguments` + :func:`run`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import platform
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CONTENDERS", "SMOKE", "add_arguments", "main", "parse_size", "run"]

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
_SECRET_OPTIONS = frozenset({"key", "secret", "token_secret", "connection_string", "account_key",
                             "sas_token", "password"})


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
    g = parser.add_argument_group("what to measure")
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

    s = parser.add_argument_group("where")
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

    o = parser.add_argument_group("output")
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
# environment facts


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "dcp-volumes", "fsspec", "s3fs", "s3torchconnector", "obstore",
                 "boto3", "gcsfs", "adlfs"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _source() -> dict[str, Any]:
    """Which dcp_volumes code was measured: its path and, in a git checkout, the commit."""
    import dcp_volumes

    pkg = Path(dcp_volumes.__file__).resolve().parent
    out: dict[str, Any] = {"path": str(pkg)}
    note = os.environ.get("DCP_VOLUMES_BENCH_SOURCE")
    if note:
        out["note"] = note
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=pkg, text=True,
                              capture_output=True, timeout=10, check=False)
        if head.returncode == 0:
            out["git_commit"] = head.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=pkg,
                                   text=True, capture_output=True, timeout=10, check=False)
            out["git_dirty"] = bool(dirty.stdout.strip())
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "machine": platform.machine()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) * 1024 / GiB, 1)
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    return info


def _command() -> str:
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith(("bench.py", "dcp_volumes.bench")) or argv0 == "-m":
        return shlex.join(["python", "-m", "dcp_volumes.bench", *sys.argv[1:]])
    return shlex.join([Path(argv0).name or "dcp-volumes", *sys.argv[1:]])


# -------------------------------------------------------------------------------------------
# where the bytes go: a local server or a named endpoint, and one endpoint per profile


class _Proxy:
    """The s3-like FaultProxy, in a child process of ours."""

    def __init__(self, upstream: str, delay: float, rate: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcp_volumes._bench_proxy", upstream, str(delay), str(rate)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"the s3-like proxy did not start (said {line!r})")
        self.endpoint_url = line.split(" ", 1)[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class _Target:
    """The store under test and how each profile reaches it."""

    protocol: str
    base_url: str  # e.g. s3://dcpv-bench/<run-id>
    server: Any = None  # LocalServer or None
    named_endpoint: str | None = None
    proxies: dict[str, _Proxy] = field(default_factory=dict)
    description: str = ""

    def endpoint(self, profile: str) -> str | None:
        if profile == "direct":
            return self.server.endpoint_url if self.server is not None else self.named_endpoint
        return self.proxies[profile].endpoint_url

    def storage_options(self, profile: str) -> dict[str, Any]:
        """Non-secret fsspec options (secrets travel in :meth:`env`)."""
        ep = self.endpoint(profile)
        if self.server is not None:
            opts = self.server.storage_options(endpoint_url=ep)
        else:
            opts = {"endpoint_url": ep} if ep else {}
        return {k: v for k, v in opts.items() if k not in _SECRET_OPTIONS}

    def env(self, profile: str) -> dict[str, str]:
        ep = self.endpoint(profile)
        if self.server is not None:
            return dict(self.server.env(endpoint_url=ep))
        env: dict[str, str] = {}
        if ep and self.protocol == "s3":
            env.update({"AWS_ENDPOINT_URL": ep, "AWS_ENDPOINT_URL_S3": ep})
            if ep.startswith("http://"):
                env["AWS_ALLOW_HTTP"] = "true"
        return env

    def fs(self) -> Any:
        import fsspec

        opts: dict[str, Any] = (self.server.storage_options() if self.server is not None
                                else self.storage_options("direct"))
        return fsspec.filesystem(self.protocol, skip_instance_cache=True, **opts)

    def remove(self, url: str) -> None:
        with contextlib.suppress(Exception):
            fs = self.fs()
            path = url.split("://", 1)[1]
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def restart(self) -> None:
        if self.server is None:
            return
        bucket = self.base_url.split("://", 1)[1].split("/", 1)[0]
        self.server.stop()
        self.server.start()
        self.server.create_bucket(bucket)

    def close(self) -> None:
        for p in self.proxies.values():
            p.stop()
        if self.server is not None:
            self.server.stop()


@contextlib.contextmanager
def _target(args: argparse.Namespace, run_id: str) -> Iterator[_Target]:
    target: _Target
    if args.endpoint_url or args.url:
        if not args.url:
            raise ValueError("--endpoint-url needs --url s3://bucket/prefix naming where to write")
        protocol = args.url.split("://", 1)[0] if "://" in args.url else ""
        if protocol not in ("s3", "gs", "az", "abfs"):
            raise ValueError(f"--url must be an s3://, gs:// or az:// URL, got {args.url!r}")
        target = _Target(protocol, f"{args.url.rstrip('/')}/{run_id}",
                         named_endpoint=args.endpoint_url,
                         description=f"endpoint {args.endpoint_url or '(default for ' + protocol + ')'}")
    else:
        from dcp_volumes.testing.servers import start_server

        server = start_server(args.server)
        root = server.create_bucket("dcpv-bench")
        target = _Target(server.protocol, f"{root}/{run_id}", server=server,
                         description=f"local {args.server} on 127.0.0.1")
    try:
        for profile in args.profiles:
            if profile == "direct":
                continue
            if profile != "s3-like":
                raise ValueError(f"unknown profile {profile!r}: use direct or s3-like")
            upstream = target.endpoint("direct")
            if not upstream or not upstream.startswith("http://"):
                raise ValueError("the s3-like profile needs an http:// endpoint to put its proxy "
                                 "in front of; pass --profiles direct for this store")
            target.proxies[profile] = _Proxy(upstream, args.first_byte_delay, args.bandwidth)
        yield target
    finally:
        target.close()


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


def _applies(contender: str, protocol: str) -> bool:
    return protocol == "s3" or not contender.startswith(_S3_ONLY)


def plan(args: argparse.Namespace, protocol: str) -> tuple[list[_Job], list[str]]:
    """The measurements of one repetition, in the order they run; and what was skipped why."""
    jobs: list[_Job] = []
    skipped: list[str] = []
    from dcp_volumes._bench_worker import parse_contender

    by_profile = {p: list(args.contenders) for p in args.profiles}
    if getattr(args, "s3_like_contenders", None) and "s3-like" in by_profile:
        by_profile["s3-like"] = list(args.s3_like_contenders)
    for c in {c for cs in by_profile.values() for c in cs}:
        parse_contender(c.split(":", 1)[0])  # validate early
        if ":" in c and c.split(":", 1)[1] != "save":
            raise ValueError(f"contender {c!r}: the only suffix is ':save' (skip the load)")
    for profile in args.profiles:
        if "save" in args.kinds:
            for entry in by_profile[profile]:
                c, _, suffix = entry.partition(":")
                extra = {"save_only": True} if suffix == "save" else {}
                if not _applies(c, protocol):
                    skipped.append(f"{c}: needs an s3:// store")
                    continue
                if c == "raw-s3fs" and protocol != "s3":
                    c = "raw-fsspec"
                if c == "local-fs" and profile != "direct":
                    continue  # no network in the way: measured once, under direct
                kind = "raw" if c.startswith("raw-") else "save_load"
                jobs.append(_Job(kind, c, profile, extra))
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


def _run_worker(specs: list[dict[str, Any]], env: dict[str, str], timeout: float,
                workdir: str, profile_to: str | None = None) -> list[dict[str, Any]]:
    spec_path = os.path.join(workdir, f"spec-{secrets.token_hex(4)}.json")
    out_path = spec_path.replace("spec-", "out-")
    with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(specs, f)
    log_path = out_path + ".log"
    argv = [sys.executable, "-m", "dcp_volumes._bench_worker", spec_path, out_path]
    if profile_to:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        argv = [spy, "record", "--format", "raw", "--rate", "200", "--subprocesses",
                "--output", profile_to, "--", *argv]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except BaseException:  # timeout or Ctrl-C
            # The worker and the rank processes it spawned form their own process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
    results: list[dict[str, Any]] = []
    with contextlib.suppress(OSError, ValueError), open(out_path) as f:
        results = json.load(f)
    if len(results) < len(specs):
        tail = ""
        with contextlib.suppress(OSError):
            tail = Path(log_path).read_text(errors="replace")[-1500:]
        why = (f"timed out after {timeout:.0f}s" if proc.returncode in (-9, 137)
               else f"worker exited with {proc.returncode}")
        results += [{"error": why, "traceback": tail}] * (len(specs) - len(results))
    for p in (spec_path, out_path, log_path):
        with contextlib.suppress(OSError):
            os.unlink(p)
    return results


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
        parts.append(f"async block {r['async_block_s']:.3f}s (copy floor "
                     f"{r['copy_prealloc_s']:.3f}s), done {r['async_done_s']:.2f}s")
    if "loads" in r:
        for w, ld in r["loads"].items():
            parts.append(f"load@{w} {ld['load_s']:.2f}s fetched/needed "
                         f"{ld['bytes_fetched'] / max(1, ld['logical_bytes_needed']):.2f}")
    if "save_rss_peak_mib" in r:
        parts.append(f"rss +{r['save_rss_peak_mib']:.0f} MiB")
    if r.get("ok") is False:
        parts.append("MISMATCH")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); returns 0 on success,
    1 if any measurement failed or loaded wrong bytes."""
    from dcp_volumes import _bench_report as report

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report.write_report(report.read_jsonl(args.report_only), out_dir,
                            plots=not args.no_plots)
        print(f"wrote {out_dir / 'results.md'}")
        return 0
    if args.smoke:
        args.size, args.reps = SMOKE["size"], SMOKE["reps"]
        args.profiles, args.contenders, args.kinds = (SMOKE["profiles"], SMOKE["contenders"],
                                                      SMOKE["kinds"])
    for p in args.profiles:
        if p not in PROFILES:
            raise ValueError(f"unknown profile {p!r}: choose from {', '.join(PROFILES)}")
    if args.reps < 1:
        raise ValueError("--reps must be >= 1")
    from dcp_volumes._bench_worker import layout_for, state_bytes, write_pool

    run_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)
    sizes = {p: (args.s3_like_size if p == "s3-like" and args.s3_like_size else args.size)
             for p in args.profiles}
    nbytes = {p: state_bytes(layout_for(size)) for p, size in sizes.items()}
    timeout = args.timeout or 120.0 + max(nbytes.values()) / 2e6
    common = {
        "schema": 1, "run_id": run_id, "command": _command(), "versions": versions(),
        "machine": machine(), "source": _source(), "part_size": args.part_size,
        "network_profiles": {"direct": None, "s3-like": {
            "first_byte_delay_s": args.first_byte_delay,
            "per_connection_bytes_per_s": args.bandwidth}},
    }
    jsonl = out_dir / "results.jsonl"
    records: list[dict[str, Any]] = []
    failures = 0
    workdir = tempfile.mkdtemp(prefix="dcpv-bench-", dir=args.spool_dir)
    started = time.monotonic()
    try:
        pool = os.path.join(workdir, "pool.bin")
        write_pool(pool, max(nbytes.values()))
        with _target(args, run_id) as target, open(jsonl, "w") as sink:
            jobs, skipped = plan(args, target.protocol)
            for line in skipped:
                print(f"skipped {line}", file=sys.stderr)
            total = len(jobs) * args.reps
            written = 0
            n = 0
            for rep in range(args.reps):
                for batch in _batches(jobs, one_process=args.smoke):
                    if target.server is not None and written >= args.restart_every:
                        target.restart()
                        written = 0
                    specs: list[dict[str, Any]] = []
                    urls: list[str] = []
                    for job in batch:
                        url = (f"{target.base_url}/r{rep}-{n + len(specs) + 1:03d}-{job.kind}-"
                               f"{job.contender}")
                        urls.append(url)
                        specs.append({
                            "kind": job.kind, "contender": job.contender, "profile": job.profile,
                            "size": sizes[job.profile], "pool": pool, "url": url,
                            "storage_options": target.storage_options(job.profile),
                            "part_size": args.part_size, "spool_dir": args.spool_dir,
                            "concurrency": args.raw_concurrency, "files": 2,
                            "timeout": timeout, **job.extra,
                        })
                    t0 = time.monotonic()
                    prof = None
                    if args.py_spy:
                        os.makedirs(args.py_spy, exist_ok=True)
                        j = batch[0]
                        prof = os.path.join(args.py_spy,
                                            f"{n + 1:03d}-{j.kind}-{j.contender}-{j.profile}.txt")
                    results = _run_worker(specs, target.env(batch[0].profile),
                                          timeout * 2 * len(specs), workdir, prof)
                    elapsed = (time.monotonic() - t0) / len(specs)
                    for url in urls:
                        target.remove(url)
                        target.remove(url + "-warmup")
                    for job, res in zip(batch, results):
                        n += 1
                        written += nbytes[job.profile] * (3 if job.kind == "async" else 2)
                        base = {**common, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                                "kind": job.kind, "contender": job.contender,
                                "profile": job.profile, "rep": rep,
                                "size_bytes": nbytes[job.profile],
                                "server": target.description, "wall_s": round(elapsed, 2),
                                **job.extra}
                        for record in _records(base, res):
                            if "error" in record or record["result"].get("ok") is False:
                                failures += 1
                            records.append(record)
                            sink.write(json.dumps(record) + "\n")
                        sink.flush()
                        print(f"[{n}/{total}] rep {rep + 1} {job.label}: "
                              f"{_summary_line(job, res)} ({elapsed:.0f}s)", file=sys.stderr,
                              flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.write_report(records, out_dir, plots=not args.no_plots)
    print(f"{len(records)} measurements in {time.monotonic() - started:.0f}s; wrote {jsonl}, "
          f"{out_dir / 'results.md'}" + ("" if args.no_plots else " and plots"))
    if failures:
        print(f"{failures} measurements failed or loaded wrong bytes (see results.jsonl)",
              file=sys.stderr)
    return 1 if failures else 0


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


if __name__ == "__main__":
    raise SystemExit(main())
