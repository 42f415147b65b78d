"""Measurement side of ``dcp-volumes bench``: runs in a fresh process per measurement.

``python -m dcp_volumes.bench.worker SPEC.json OUT.json`` runs the jobs listed in the spec
file and writes one result dict per job. The harness (:mod:`dcp_volumes.bench.harness`)
starts one worker per measurement so that peak RSS, allocator state and warm connections of
one contender never leak into another's figures. Secrets never appear in a spec: credentials
reach the clients through the environment the harness gives the worker.

Every contender saves the same state dict (tensors filled from one random "pool" file, so
that each process can rebuild exactly the same bytes and check what it loads; see
:mod:`dcp_volumes.bench.state`), warms its clients with a tiny save and load first, and then
is timed on one ``dcp.save`` and one ``dcp.load`` (:mod:`dcp_volumes.bench.jobs`,
:mod:`dcp_volumes.bench.raw`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from dcp_volumes.bench.contenders import parse_contender
from dcp_volumes.bench.jobs import job_async, job_reshard, job_save_load, job_scaling
from dcp_volumes.bench.raw import job_raw

__all__ = ["JOBS", "main", "run_job"]

JOBS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "save_load": job_save_load, "raw": job_raw, "async": job_async,
    "scaling": job_scaling, "reshard": job_reshard,
}


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    local_dir = None
    try:
        if spec["kind"] == "save_load" and parse_contender(spec["contender"])["family"] == "local":
            local_dir = tempfile.mkdtemp(prefix="dcpv-bench-local-", dir=spec.get("spool_dir"))
            spec = {**spec, "local_dir": local_dir}
        return {"result": JOBS[spec["kind"]](spec)}
    except Exception as exc:  # noqa: BLE001 — reported, the run goes on
        tb = traceback.format_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-4000:]}
    finally:
        if local_dir is not None:
            shutil.rmtree(local_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m dcp_volumes.bench.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        specs = json.load(f)
    results = []
    for spec in specs:
        results.append(run_job(spec))
        # Write after each job so a timeout keeps what finished.
        tmp = argv[1] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    # Before anything imports gcsfs. The jobs live in importable modules, so run_ranks
    # pickles the rank functions by their real names.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    raise SystemExit(main())
