"""``python -m dcp_volumes.bench``: the benchmark harness (:mod:`dcp_volumes.bench.harness`)."""

from __future__ import annotations

from dcp_volumes.bench.harness import main

if __name__ == "__main__":
    raise SystemExit(main())
