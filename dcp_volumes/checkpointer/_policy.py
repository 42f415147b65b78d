"""When a Checkpointer saves: the cadences as one frozen, validated object with an
injectable clock, and the marks (last step, last save times) it is judged against; and
what it keeps (:func:`retain`)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dcp_volumes import catalog, errors
from dcp_volumes.backends import redact_url
from dcp_volumes.config import RetryOptions, SpoolOptions, TransferOptions
from dcp_volumes.tier import name_under, normal_url

__all__ = ["Marks", "SaveKind", "SavePolicy", "check_local_only", "check_options",
           "check_step_format", "retain", "step_of_url"]

logger = logging.getLogger(__name__)

SaveKind = Literal["durable", "local-only"]


@dataclass
class Marks:
    """What the policy is judged against: the step saved last, when the last durable save
    started (``every_seconds``) and when the last save of either kind did
    (``local_every_seconds``), in the policy's clock."""

    last_step: int | None = None
    last_save_t: float = 0.0
    last_local_t: float = 0.0

    def saved(self, step: int, now: float, *, durable: bool) -> None:
        self.last_step = step
        self.last_local_t = now
        if durable:
            self.last_save_t = now

    def reset(self, now: float, step: int | None = None) -> None:
        """Both clocks start now (construction, a resume)."""
        self.last_step = step
        self.last_save_t = self.last_local_t = now


def _check_steps(name: str, steps: object) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                              or steps < 1):
        raise errors.ConfigError(f"{name} must be a whole number >= 1 or None, got {steps!r}")


def _check_seconds(name: str, seconds: object) -> None:
    if seconds is not None and (isinstance(seconds, bool)
                                or not isinstance(seconds, (int, float)) or not seconds > 0
                                or seconds == float("inf")):
        raise errors.ConfigError(f"{name} must be > 0 or None, got {seconds!r}")


@dataclass(frozen=True)
class SavePolicy:
    """The cadences of a :class:`~dcp_volumes.Checkpointer` (see its arguments).

    Args:
        every_steps: a durable save every this many steps.
        every_seconds: a durable save every this many seconds.
        local_every_steps: a local-only save every this many steps (needs a durable cadence).
        local_every_seconds: a local-only save every this many seconds (likewise).
        drain: wait for the previous durable save before starting the next.
        clock: monotonic seconds (tests and simulations pass their own).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    local_every_steps: int | None = None
    local_every_seconds: float | None = None
    drain: bool = False
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        _check_steps("every_steps", self.every_steps)
        _check_steps("local_every_steps", self.local_every_steps)
        _check_seconds("every_seconds", self.every_seconds)
        _check_seconds("local_every_seconds", self.local_every_seconds)
        if not isinstance(self.drain, bool):
            raise errors.ConfigError(f"drain= must be True or False, got {self.drain!r}")
        if not callable(self.clock):
            raise errors.ConfigError("clock= must be a function returning seconds")
        if self.local_cadence and self.every_steps is None and self.every_seconds is None:
            raise errors.ConfigError(
                "local_every_steps / local_every_seconds need a durable cadence too: set "
                "every_steps or every_seconds (local-only saves alone are never durable)")

    @property
    def local_cadence(self) -> bool:
        return self.local_every_steps is not None or self.local_every_seconds is not None

    @property
    def timed(self) -> bool:
        """A cadence in seconds is set: ranks must agree on the clock (rank 0's)."""
        return self.every_seconds is not None or self.local_every_seconds is not None

    def check_with(self, *, local_tier: bool, async_save: bool) -> None:
        """The checks that need the rest of the Checkpointer's options."""
        if self.local_cadence and not local_tier:
            raise errors.ConfigError(
                "local_every_steps / local_every_seconds make local-only saves, which need a "
                "local tier: pass local_tier=LocalTierOptions(directory=...)")
        if self.drain and not (self.local_cadence and async_save):
            raise errors.ConfigError(
                "drain=True turns local-only saves into durable ones while no upload is in "
                "flight: it needs async_save=True and local_every_steps / local_every_seconds")

    def due(self, step: int, marks: Marks) -> SaveKind | None:
        """Which save is due at ``step``: ``"durable"``, ``"local-only"`` (the local cadence,
        between durable saves) or ``None``. A step due for both is durable; the step saved
        last is never due again."""
        if step == marks.last_step:
            return None
        if self.every_steps is None and self.every_seconds is None:
            return "durable"
        if self.every_steps is not None and step % self.every_steps == 0:
            return "durable"
        now = self.clock()
        if self.every_seconds is not None and now - marks.last_save_t >= self.every_seconds:
            return "durable"
        if (self.local_every_steps is not None and step % self.local_every_steps == 0) or (
                self.local_every_seconds is not None
                and now - marks.last_local_t >= self.local_every_seconds):
            return "local-only"
        return None


def retain(root: str, step: int, *, keep_last: int | None, keep_every: int | None,
           storage_options: dict[str, Any], step_pattern: re.Pattern[str] | str | None
           ) -> None:
    """Apply the run's retention after the commit of ``step``; a failure is a WARNING (the
    checkpoint is committed: old ones stay until the next save)."""
    try:
        removed = catalog.apply_retention(root, keep_last=keep_last, keep_every=keep_every,
                                          storage_options=storage_options,
                                          step_pattern=step_pattern)
    except Exception as exc:  # noqa: BLE001 -- the checkpoint is committed; say, don't fail
        logger.warning("retention after step %d failed (%s: %s); old checkpoints stay until "
                       "the next save", step, type(exc).__name__, exc)
        return
    if removed:
        logger.info("retention removed %d checkpoints: %s", len(removed),
                    ", ".join(redact_url(u) for u in removed))


def check_step_format(step_format: str, pattern: re.Pattern[str]) -> None:
    """``step_format`` makes one directory name per step that ``pattern`` parses back."""
    try:
        name = step_format.format(step=1234)
    except (KeyError, IndexError, ValueError) as exc:
        raise errors.ConfigError(
            f"step_format {step_format!r} is not a format string with {{step}} "
            f"({type(exc).__name__}); use e.g. 'step-{{step:08d}}'"
        ) from None
    if "/" in name or catalog.step_of(name, pattern) != 1234:
        raise errors.ConfigError(
            f"step_format {step_format!r} makes names like {name!r} that the step "
            f"pattern {pattern.pattern!r} does not parse back to 1234: pass a "
            "matching step_pattern (and no '/' in the name)"
        )


def check_options(*, spool: object, transfer: object, retry: object) -> None:
    """The Checkpointer's option objects are of their types."""
    for name, value, cls in (("spool", spool, SpoolOptions),
                             ("transfer", transfer, TransferOptions),
                             ("retry", retry, RetryOptions)):
        if value is not None and not isinstance(value, cls):
            raise errors.ConfigError(
                f"{name}= must be a {cls.__name__} or None, got {type(value).__name__}")


def check_local_only(local_only: object, *, has_tier: bool) -> None:
    """``save(..., local_only=)`` is True, False or None, and True only with a local tier."""
    if local_only is not None and not isinstance(local_only, bool):
        raise errors.ConfigError(
            f"local_only= must be True, False or None, got {local_only!r}")
    if local_only and not has_tier:
        raise errors.ConfigError(
            "save(..., local_only=True) writes to the local tier only, and this "
            "Checkpointer has none: pass Checkpointer(..., local_tier=LocalTierOptions("
            "directory=...)), or save without local_only=True")


def step_of_url(root: str, url: str, pattern: re.Pattern[str],
                url_for: Callable[[int], str]) -> int | None:
    """The step of a checkpoint URL of the run at ``root`` (None: not one of its steps)."""
    name = name_under(root, url)
    step = catalog.step_of(name, pattern) if name is not None else None
    if step is None or normal_url(url_for(step)) != normal_url(url):
        return None
    return step
