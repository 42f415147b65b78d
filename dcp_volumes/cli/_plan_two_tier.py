"""``dcp-volumes plan --local-save-s``: remote-only against two tiers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dcp_volumes.cli._exit import EXIT_OK
from dcp_volumes.cli._format import print_json
from dcp_volumes.cli._plan_table import print_two_tier
from dcp_volumes.errors import ConfigError

if TYPE_CHECKING:
    from dcp_volumes.goodput import FailureModel

__all__ = ["run_two_tier"]


def run_two_tier(
    args: argparse.Namespace, model: FailureModel, cost_s: float, source: str
) -> int:
    from dcp_volumes.goodput import TierCosts, parse_duration_s, plan_two_level

    for flag, value in (("--intervals", args.intervals), ("--plot", args.plot)):
        if value is not None:
            raise ConfigError(f"{flag} does not apply with --local-save-s (two tiers)")
    if args.daly:
        raise ConfigError("--daly does not apply with --local-save-s (two tiers)")
    if args.local_survives is None:
        raise ConfigError(
            "with --local-save-s, give --local-survives SHARE: the share of failures after "
            "which the local copies are usable (e.g. 0.8; see docs/goodput.md)"
        )
    if (args.local_every is None) != (args.remote_every is None):
        raise ConfigError("--local-every and --remote-every go together; give both or neither")
    given = None
    if args.local_every is not None:
        given = (parse_duration_s(args.local_every), parse_duration_s(args.remote_every))
    costs = TierCosts(
        local_save_s=args.local_save_s,
        remote_save_s=cost_s,
        local_survives=args.local_survives,
        local_complete_s=args.local_complete_s,
        remote_complete_s=args.remote_complete_s,
        local_restore_s=args.local_restore_s,
        remote_restore_s=args.remote_restore_s,
        restart_s=args.restart_cost_s,
    )
    plan = plan_two_level(model, costs=costs, job_hours=args.job_hours, given=given)
    if args.json:
        doc = plan.to_dict()
        doc["remote_save_source"] = source
        print_json(doc)
    else:
        print_two_tier(plan, source=source)
    return EXIT_OK
