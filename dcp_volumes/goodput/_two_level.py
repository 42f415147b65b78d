"""Two tiers: frequent cheap local saves, rarer durable ones. See :mod:`dcp_volumes.goodput`
and ``docs/goodput.md`` ("Two tiers").

The job makes a save every ``τ_L`` of useful work; every ``τ_R`` of work that save is durable
(it goes to the store, and keeps a local copy too), the others are local-only. A share ``p`` of
failures leaves the local copies usable (a crashed process, a job requeued on its nodes, a lost
node whose partner holds a replica); the rest (lost nodes without replicas, several nodes, the
disks) restart from the store. Per unit of useful work, the saves block

    c = δ_L/τ_L + (δ_R − δ_L)/τ_R

and a failure costs, in wall time,

    p·(R + L_L + U_L + (1+c)·τ_L/2) + (1−p)·(R + L_R + U_R + (1+c)·τ_R/2)

(restart, restore from the tier that survived, the completion lag of a save, and half the work
since that tier's last save, redone with its saves). Goodput to first order:

    G = 1/(1+c) · (1 − E[loss per failure] / M)        clipped at 0.

Minimising the first-order expansion ``c + p·τ_L/(2M) + (1−p)·τ_R/(2M)`` term by term gives
Young's formula once per tier:

    τ_L = √(2·δ_L·M / p)        τ_R = √(2·(δ_R − δ_L)·M / (1 − p))

when that gives ``τ_L < τ_R``; otherwise local-only saves do not pay and both are Young's
``√(2·δ_R·M)`` (every save durable). With ``p = 0`` the model is the one-level model of
:func:`~dcp_volumes.goodput.expected_goodput` with restart ``R + L_R + U_R``.

The comparison of remote-only against two tiers (:func:`plan_two_level`, its rows and
warnings) is :mod:`._two_level_compare`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dcp_volumes.errors import ConfigError
from dcp_volumes.goodput._checks import (
    MAX_DURATION_S,
    non_negative,
    positive,
)
from dcp_volumes.goodput._durations import format_duration

__all__ = [
    "TierCosts",
    "check_pair",
    "expected_loss_per_failure_s",
    "overhead_per_work",
    "two_level_goodput",
    "two_level_intervals_s",
]


@dataclass(frozen=True, kw_only=True)
class TierCosts:
    """Measured (or assumed) costs of the two kinds of save and of a restart.

    Args:
        local_save_s: Time a local-only save blocks training ``δ_L`` (> 0).
        remote_save_s: Time a durable save blocks training ``δ_R`` (> 0): a blocking save's
            duration, or what ``async_save`` blocks.
        local_complete_s: Lag from a local save's return to its copy being usable ``U_L``
            (0 for a blocking save).
        remote_complete_s: Lag from a durable save's return to its commit in the store
            ``U_R`` (the upload of an ``async_save``; 0 for a blocking save).
        local_restore_s: Time to load the state from the local tier ``L_L``.
        remote_restore_s: Time to load the state from the store ``L_R``.
        restart_s: Everything else a restart costs ``R``: detect, reschedule, start the
            processes, warm up.
        local_survives: Share of failures after which the local copies are usable ``p``,
            in ``[0, 1)``.

    Raises:
        ConfigError: A negative, NaN or infinite value, or ``local_survives`` outside
            ``[0, 1)``.
    """

    local_save_s: float
    remote_save_s: float
    local_survives: float
    local_complete_s: float = 0.0
    remote_complete_s: float = 0.0
    local_restore_s: float = 0.0
    remote_restore_s: float = 0.0
    restart_s: float = 0.0

    def __post_init__(self) -> None:
        positive("local_save_s", self.local_save_s, at_most=MAX_DURATION_S)
        positive("remote_save_s", self.remote_save_s, at_most=MAX_DURATION_S)
        for name in (
            "local_complete_s",
            "remote_complete_s",
            "local_restore_s",
            "remote_restore_s",
            "restart_s",
        ):
            non_negative(name, getattr(self, name), at_most=MAX_DURATION_S)
        p = non_negative("local_survives", self.local_survives)
        if p >= 1.0:
            raise ConfigError(
                f"local_survives is the share of failures the local tier survives, in [0, 1), "
                f"got {p:g}; storage loss and multi-node failures always need the store, so "
                "use e.g. 0.8, or 0.95 with peer replicas"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "local_save_s": self.local_save_s,
            "remote_save_s": self.remote_save_s,
            "local_complete_s": self.local_complete_s,
            "remote_complete_s": self.remote_complete_s,
            "local_restore_s": self.local_restore_s,
            "remote_restore_s": self.remote_restore_s,
            "restart_s": self.restart_s,
            "local_survives": self.local_survives,
        }


def overhead_per_work(local_s: float, remote_s: float, costs: TierCosts) -> float:
    """``c``: blocked time per unit of useful work."""
    return costs.local_save_s / local_s + (costs.remote_save_s - costs.local_save_s) / remote_s


def check_pair(local_interval_s: float, remote_interval_s: float) -> tuple[float, float]:
    """The two intervals checked: positive, and the local one at most the remote one."""
    tl = positive("local_interval_s", local_interval_s)
    tr = positive("remote_interval_s", remote_interval_s)
    if tl > tr:
        raise ConfigError(
            f"local_interval_s ({format_duration(tl)}) is longer than remote_interval_s "
            f"({format_duration(tr)}); every durable save also keeps a local copy, so the "
            "local interval is at most the remote one (equal: no local-only saves)"
        )
    return tl, tr


def expected_loss_per_failure_s(
    local_interval_s: float, remote_interval_s: float, *, costs: TierCosts
) -> float:
    """Wall time one failure costs on average (restart, restore, rework), two-tier model."""
    tl, tr = check_pair(local_interval_s, remote_interval_s)
    c = overhead_per_work(tl, tr, costs)
    p = costs.local_survives
    local = costs.restart_s + costs.local_restore_s + costs.local_complete_s + (1 + c) * tl / 2
    remote = costs.restart_s + costs.remote_restore_s + costs.remote_complete_s + (1 + c) * tr / 2
    return p * local + (1 - p) * remote


def two_level_goodput(
    local_interval_s: float, remote_interval_s: float, *, costs: TierCosts, mttf_s: float
) -> float:
    """Expected goodput with a local save every ``local_interval_s`` of work and a durable one
    every ``remote_interval_s``: ``1/(1+c) · (1 − E[loss per failure]/M)``, clipped at 0.

    ``local_interval_s == remote_interval_s`` means every save is durable (no local-only
    saves); with ``costs.local_survives == 0`` too, this equals
    :func:`~dcp_volumes.goodput.expected_goodput` with restart ``R + L_R + U_R``.

    Raises:
        ConfigError: A non-positive interval, or the local interval longer than the remote.
    """
    tl, tr = check_pair(local_interval_s, remote_interval_s)
    m = positive("mttf_s", mttf_s, allow_inf=True)
    c = overhead_per_work(tl, tr, costs)
    loss = 0.0 if math.isinf(m) else expected_loss_per_failure_s(tl, tr, costs=costs) / m
    return max(0.0, (1.0 - loss) / (1.0 + c))


def two_level_intervals_s(*, costs: TierCosts, mttf_s: float) -> tuple[float, float]:
    """The recommended ``(local, remote)`` intervals: Young's formula once per tier.

    ``τ_L = √(2·δ_L·M/p)`` and ``τ_R = √(2·(δ_R − δ_L)·M/(1−p))`` when ``τ_L < τ_R``;
    otherwise ``τ_L = τ_R = √(2·δ_R·M)`` (local-only saves do not pay: every save durable).
    Both are ``inf`` when ``M`` is ``inf``.
    """
    m = positive("mttf_s", mttf_s, allow_inf=True)
    if math.isinf(m):
        return math.inf, math.inf
    p, dl, dr = costs.local_survives, costs.local_save_s, costs.remote_save_s
    if p > 0 and dr > dl:
        tl = math.sqrt(2.0 * dl * m / p)
        tr = math.sqrt(2.0 * (dr - dl) * m / (1.0 - p))
        if tl < tr:
            return tl, tr
    one = math.sqrt(2.0 * dr * m)
    return one, one
