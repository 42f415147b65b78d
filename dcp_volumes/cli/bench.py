"""``dcp-volumes bench``: the benchmark harness (:mod:`dcp_volumes.bench`) as a subcommand."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``bench`` to ``sub``."""
    # The harness is a tool, not the library: it is imported only when the parser is built.
    from dcp_volumes import bench

    p = sub.add_parser(
        "bench",
        parents=[common],
        help="benchmark save/load against torch's writers, s3torchconnector and raw uploads",
        description=(bench.__doc__ or "").strip().splitlines()[0],
    )
    bench.add_arguments(p)
    p.set_defaults(handler=bench.run)
