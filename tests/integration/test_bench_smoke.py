"""The benchmark harness runs end to end (``python -m dcp_volumes.bench --smoke``).

No timing asserts: the smoke run checks that every contender saves, loads back the same
bytes and reports its figures, and that the report (JSON lines, markdown, plots) is written.
The report code is also checked on hand-made records, without any server.
"""

from __future__ import annotations

# servers must be imported before anything imports gcsfs (it sets the gcsfs env switch).
from dcp_volumes.testing import servers as srv  # isort: skip

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes.bench import harness, report

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64MiB", 64 << 20), ("1GiB", 1 << 30), ("512M", 512 << 20), ("10MB", 10_000_000),
     ("4096", 4096), ("1.5KiB", 1536)],
    ids=["MiB", "GiB", "M-is-binary", "MB-is-decimal", "bytes", "fraction"],
)
def test_parse_size(text: str, expected: int) -> None:
    assert harness.parse_size(text) == expected


def test_parse_size_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        harness.parse_size("lots")


def test_add_arguments_registers_on_any_parser() -> None:
    parser = argparse.ArgumentParser(prog="dcp-volumes bench")
    harness.add_arguments(parser)
    args = parser.parse_args(["--size", "64MiB", "--profiles", "direct", "--reps", "1"])
    assert args.size == 64 << 20 and args.profiles == ("direct",) and args.reps == 1


def _record(kind: str, contender: str, profile: str, rep: int, result: dict[str, Any],
            **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "contender": contender, "profile": profile, "rep": rep,
            "size_bytes": 100 << 20, "part_size": 16 << 20, "command": "x", "versions": {},
            "machine": {}, "result": result, **extra}


def test_report_on_synthetic_records(tmp_path: Path) -> None:
    mib = 1 << 20
    recs = []
    for rep, jitter in enumerate((1.0, 1.1, 0.9)):
        recs += [
            _record("save_load", "vol-disk", "direct", rep,
                    {"bytes": 100 * mib, "save_s": 1.0 * jitter, "load_s": 0.5,
                     "save_rss_peak_mib": 100.0, "ok": True,
                     "writer_stats": {"spool_s": 0.4, "upload_tail_s": 0.5, "commit_s": 0.1}}),
            _record("save_load", "fsspec-t1", "direct", rep,
                    {"bytes": 100 * mib, "save_s": 4.0 * jitter, "load_s": 2.0, "ok": True}),
            _record("save_load", "s3tc-t8", "direct", rep,
                    {"bytes": 100 * mib, "save_s": 2.0, "load_s": 0.4, "ok": True}),
            _record("raw", "raw-obstore", "direct", rep,
                    {"bytes": 100 * mib, "save_s": 0.98, "load_s": 0.25, "ok": True}),
            _record("async", "vol-disk", "direct", rep,
                    {"bytes": 100 * mib, "async_block_s": 0.05, "async_done_s": 1.2,
                     "async_first_block_s": 0.2, "copy_prealloc_s": 0.045,
                     "copy_clone_s": 0.1}),
            _record("reshard", "vol-disk", "direct", rep,
                    {"bytes": 100 * mib, "save_s": 1.0, "ok": True, "loads": {
                        "3": {"load_s": 1.0, "bytes_needed": 200 * mib,
                              "bytes_fetched": 200 * mib, "logical_bytes_needed": 100 * mib,
                              "ranges": 9}}}),
        ]
    recs.append({**_record("save_load", "vol-memory-c8", "direct", 0, {}), "error": "boom"})
    del recs[-1]["result"]
    md = report.render_markdown(recs)
    assert "| `vol-disk` | 1.00 (0.90–1.10) |" in md
    assert "## async_save" in md and "## Resharded loads" in md and "## Failures" in md
    verdicts = {t.name: t for t in report.targets(recs)}
    raw = verdicts["direct: save time ÷ fastest raw upload"]
    assert raw.ratio == pytest.approx(1.0 / 0.98) and raw.passed is True
    assert verdicts["direct: load time ÷ s3tc-t8 load time"].passed is False
    assert verdicts["direct: 2→3 ranks bytes fetched ÷ bytes the new shards need"].ratio == 2.0
    report.write_report(recs, tmp_path, plots=False)
    assert (tmp_path / "results.md").read_text() == md


@pytest.mark.servers
@pytest.mark.timeout(180)
def test_bench_smoke_runs_end_to_end(tmp_path: Path) -> None:
    try:
        srv.SeaweedFSServer()._find_binary()
    except srv.ServerNotAvailableError as exc:
        pytest.skip(str(exc))
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_volumes.bench", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=170, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = report.read_jsonl(tmp_path / "results.jsonl")
    kinds = {(r["kind"], r["contender"]) for r in records}
    assert {("save_load", c) for c in ("vol-disk", "fsspec-t1", "local-fs")} <= kinds
    assert {("raw", "raw-s3fs"), ("async", "vol-disk"), ("reshard", "vol-disk")} <= kinds
    for r in records:
        assert "result" in r, r.get("traceback")
        assert r["result"].get("ok", True) is True
        assert r["versions"]["torch"] and r["machine"]["cpu_count"]
        assert "dcp_volumes.bench --smoke" in r["command"]
    vol = next(r for r in records if r["contender"] == "vol-disk" and r["kind"] == "save_load")
    assert vol["result"]["writer_stats"]["bytes"] > 0
    assert vol["result"]["reader_stats"]["verified"] is True
    md = (tmp_path / "results.md").read_text()
    assert "## Save and load — `direct`" in md and "## Targets" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "async_blocking.png").stat().st_size > 0
    json.dumps(records)  # the records stay plain JSON
