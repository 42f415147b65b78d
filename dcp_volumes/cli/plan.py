"""``dcp-volumes plan``: choose a checkpoint interval from a failure rate and a checkpoint cost.

The model is :mod:`dcp_volumes.goodput`; the cost comes from the command line or from a
``dcp-volumes bench`` results file (:mod:`dcp_volumes.bench.costs`); ``--plot`` draws
:func:`plot_goodput`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_volumes.cli._exit import EXIT_OK
from dcp_volumes.cli._format import print_json
from dcp_volumes.cli._options import (
    gpu_count,
    non_negative_float,
    positive_float,
    positive_or_inf,
    storage_options_parser,
)
from dcp_volumes.cli._plan_run import run_from_run
from dcp_volumes.cli._plan_table import print_plan
from dcp_volumes.cli._plan_two_tier import run_two_tier
from dcp_volumes.cli._plot import plot_goodput
from dcp_volumes.errors import ConfigError

if TYPE_CHECKING:
    from dcp_volumes.goodput import FailureModel, Plan

__all__ = ["plot_goodput", "register"]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``plan`` to ``sub``."""
    _add_plan(sub, common)


def _add_plan(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan",
        parents=[common, storage_options_parser()],
        help="choose a checkpoint interval from a failure rate and checkpoint cost",
        description=(
            "Expected goodput over checkpoint intervals, the Young/Daly optimal interval\n"
            "and the odds of an interruption, from a failure rate and a checkpoint cost.\n"
            "Model, assumptions and limits: docs/goodput.md."
        ),
        epilog=(
            "examples:\n"
            "  dcp-volumes plan --gpus 1024 --afr 0.05 --checkpoint-cost-s 45 "
            "--restart-cost-s 600 --job-hours 720\n"
            "  dcp-volumes plan --gpus 4096 --fleet-mtbf-hours 3 --fleet-gpus 16384 "
            "--from-bench bench.jsonl --contender dcp_volumes --async --json\n"
            "  dcp-volumes plan --from-run s3://bucket/run-42 --afr 0.01 --gpus 1024"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--gpus",
        type=gpu_count,
        metavar="N",
        help="GPUs the job needs at once; any one failing interrupts it (required, except "
        "with --from-run: the run's world size)",
    )
    p.add_argument(
        "--from-run",
        metavar="ROOT",
        help="the costs and the failure estimate from the run record under ROOT (written by "
        "Checkpointer(every_seconds=\"auto\")); --afr or --fleet-* are then the prior",
    )
    rate = p.add_argument_group("failure rate (one of)")
    rate.add_argument(
        "--afr",
        type=non_negative_float,
        metavar="RATE",
        help="per-GPU annualised failure rate as a fraction (0.05 = 5%%/year)",
    )
    rate.add_argument(
        "--fleet-mtbf-hours",
        type=positive_or_inf,
        metavar="T",
        help="observed hours between failures across a fleet of --fleet-gpus",
    )
    rate.add_argument("--fleet-gpus", type=gpu_count, metavar="G", help="GPUs in that fleet")
    cost = p.add_argument_group("checkpoint cost (one of)")
    cost.add_argument(
        "--checkpoint-cost-s",
        type=positive_float,
        metavar="SECONDS",
        help="time one checkpoint blocks training",
    )
    cost.add_argument(
        "--from-bench",
        type=Path,
        metavar="FILE",
        help="median cost from a `dcp-volumes bench` JSON-lines file",
    )
    cost.add_argument(
        "--contender", metavar="NAME", help="with --from-bench: only lines of this contender"
    )
    cost.add_argument(
        "--async",
        dest="use_async",
        action="store_true",
        help=(
            "with --from-bench: use async_block_s (what async_save blocks) not save_s; the "
            "upload still delays durability, so add its duration to --restart-cost-s"
        ),
    )
    p.add_argument(
        "--restart-cost-s",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="time from a failure to training again: reschedule, load, warm up (default 0)",
    )
    p.add_argument(
        "--job-hours",
        type=positive_float,
        metavar="HOURS",
        help="job duration, for the odds of an interruption and the hours lost",
    )
    p.add_argument(
        "--intervals",
        metavar="LIST",
        help="candidate intervals, e.g. 5m,30m,1h,4h (units s, m, h, d; default "
        "5m,10m,15m,30m,1h,2h,4h,8h,12h,24h)",
    )
    _add_two_tier_options(p)
    p.add_argument("--daly", action="store_true", help="report Daly's optimum instead of Young's")
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="also write goodput against interval to this PNG"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=_run_plan)


def _add_two_tier_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "two tiers (with --local-save-s: compare remote-only with local + durable saves)",
        "The checkpoint cost is then the durable save's, and --restart-cost-s the restart "
        "without loading the state (the restore times below add to it).",
    )
    g.add_argument("--local-save-s", type=positive_float, metavar="SECONDS",
                   help="time a local-only save blocks training")
    g.add_argument("--local-survives", type=non_negative_float, metavar="SHARE",
                   help="share of failures after which the local copies are usable, in [0, 1) "
                   "(e.g. 0.8)")
    g.add_argument("--local-restore-s", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="time to load the state from the local tier (default 0)")
    g.add_argument("--remote-restore-s", type=non_negative_float, default=0.0,
                   metavar="SECONDS", help="time to load the state from the store (default 0)")
    g.add_argument("--local-complete-s", type=non_negative_float, default=0.0,
                   metavar="SECONDS",
                   help="lag from a local save's return to its copy being usable (default 0)")
    g.add_argument("--remote-complete-s", type=non_negative_float, default=0.0,
                   metavar="SECONDS", help="lag from a durable save's return to its commit "
                   "(the upload of an async save; default 0)")
    g.add_argument("--local-every", metavar="DURATION",
                   help="also evaluate this local interval (with --remote-every), e.g. 10m")
    g.add_argument("--remote-every", metavar="DURATION",
                   help="also evaluate this remote interval (with --local-every), e.g. 2h")


_TWO_TIER_ONLY = ("local_survives", "local_every", "remote_every")


def _run_plan(args: argparse.Namespace) -> int:
    from dcp_volumes.goodput import DEFAULT_INTERVALS_S, parse_duration_s, plan_intervals

    if args.from_run is not None:
        return run_from_run(args, lambda gpus: _failure_model(args, gpus, prior=True),
                            lambda plan, extra, doc: _emit(args, plan, extra, doc))
    model = _failure_model(args, args.gpus)
    assert model is not None
    cost_s, source = _checkpoint_cost(args)
    if args.local_save_s is not None:
        return run_two_tier(args, model, cost_s, source)
    used = [f"--{n.replace('_', '-')}" for n in _TWO_TIER_ONLY if getattr(args, n) is not None]
    if used:
        raise ConfigError(f"{', '.join(used)} only apply with --local-save-s SECONDS")
    intervals = (
        [parse_duration_s(t) for t in args.intervals.split(",") if t.strip()]
        if args.intervals is not None
        else DEFAULT_INTERVALS_S
    )
    plan = plan_intervals(
        model,
        checkpoint_cost_s=cost_s,
        restart_cost_s=args.restart_cost_s,
        job_hours=args.job_hours,
        intervals_s=intervals,
        method="daly" if args.daly else "young",
        cost_source=source,
    )
    return _emit(args, plan, [], {})


def _emit(args: argparse.Namespace, plan: Plan, extra: list[tuple[str, str]],
          doc_extra: dict[str, Any]) -> int:
    """The plan as a table (with ``extra`` summary lines) or JSON (with ``doc_extra``)."""
    plot = plot_goodput(plan, args.plot) if args.plot is not None else None
    if args.json:
        doc = plan.to_dict()
        doc["plot"] = str(plot) if plot is not None else None
        doc.update(doc_extra)
        print_json(doc)
    else:
        print_plan(plan, plot=plot, extra=extra)
    return EXIT_OK


def _checkpoint_cost(args: argparse.Namespace) -> tuple[float, str]:
    """``δ`` in seconds, and where it came from in words."""
    if args.checkpoint_cost_s is not None and args.from_bench is not None:
        raise ConfigError("give --checkpoint-cost-s or --from-bench, not both")
    if args.from_bench is None and (args.contender is not None or args.use_async):
        raise ConfigError("--contender and --async only apply with --from-bench FILE")
    if args.from_bench is not None:
        from dcp_volumes.bench.costs import checkpoint_cost_from_bench

        bench = checkpoint_cost_from_bench(
            args.from_bench, contender=args.contender, use_async=args.use_async
        )
        return bench.seconds, bench.describe()
    if args.checkpoint_cost_s is not None:
        return args.checkpoint_cost_s, "given"
    raise ConfigError(
        "give the checkpoint cost: --checkpoint-cost-s SECONDS or --from-bench FILE"
    )


def _failure_model(args: argparse.Namespace, gpus: int | None, *,
                   prior: bool = False) -> FailureModel | None:
    """The failure rate the flags give for ``gpus`` GPUs; with ``prior`` (``--from-run``)
    None when no rate flag is given (the autopilot's default prior then)."""
    from dcp_volumes.goodput import FailureModel

    fleet = args.fleet_mtbf_hours is not None or args.fleet_gpus is not None
    if args.afr is not None and fleet:
        raise ConfigError("give --afr or --fleet-mtbf-hours with --fleet-gpus, not both")
    if prior and args.afr is None and not fleet:
        return None
    if gpus is None:
        raise ConfigError("the following arguments are required: --gpus (the GPUs the job "
                          "needs at once), unless --from-run ROOT")
    if args.afr is not None:
        return FailureModel.from_afr(args.afr, gpus=gpus)
    if args.fleet_mtbf_hours is None or args.fleet_gpus is None:
        raise ConfigError(
            "give a failure rate: --afr RATE (e.g. 0.05), or --fleet-mtbf-hours T together "
            "with --fleet-gpus G"
        )
    return FailureModel.from_fleet(
        mtbf_hours=args.fleet_mtbf_hours, fleet_gpus=args.fleet_gpus, gpus=gpus
    )
