"""Validation shared by the goodput modules: every message names the argument, says what to
pass instead and, for a value out of range, what the valid range is."""

from __future__ import annotations

import math

from dcp_volumes.errors import ConfigError

__all__ = [
    "FIRST_ORDER_LIMIT",
    "MAX_DURATION_S",
    "MAX_GPUS",
    "MIN_FLEET_MTBF_HOURS",
    "count",
    "finite_or_none",
    "mttf",
    "non_negative",
    "number",
    "positive",
]

#: the first-order model drops terms of order ((τ+δ)/M)²; past this ratio they stop being small
FIRST_ORDER_LIMIT = 0.1
#: the longest duration a plan takes as input (about 31.7 years): anything longer is a typo
#: or a unit mistake, and would only make the arithmetic overflow
MAX_DURATION_S = 1e9
#: the most GPUs a plan takes (job or fleet)
MAX_GPUS = 10_000_000
#: the shortest fleet MTBF a plan takes (one second): a fleet failing more often than that
#: trains nothing
MIN_FLEET_MTBF_HOURS = 1.0 / 3600.0


def number(name: str, value: object) -> float:
    """``value`` as a float; refuses bools, non-numbers and NaN."""
    # bool is an int subclass; True GPUs or an AFR of False is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if math.isnan(value):
        raise ConfigError(f"{name} is NaN; pass a real number")
    return float(value)


def _at_most(name: str, x: float, at_most: float | None, low: str) -> float:
    if at_most is not None and math.isfinite(x) and x > at_most:
        raise ConfigError(
            f"{name} must be at most {at_most:g} (valid range: {low} to {at_most:g}), got {x:g}"
        )
    return x


def non_negative(name: str, value: object, *, allow_inf: bool = False,
                 at_most: float | None = None) -> float:
    """A number ``>= 0`` (and ``<= at_most`` when given); ``inf`` only with ``allow_inf``."""
    x = number(name, value)
    if x < 0:
        raise ConfigError(f"{name} must be >= 0, got {x:g}")
    if math.isinf(x) and not allow_inf:
        raise ConfigError(f"{name} must be finite, got {x:g}")
    return _at_most(name, x, at_most, "0")


def positive(name: str, value: object, *, allow_inf: bool = False,
             at_most: float | None = None) -> float:
    """A number ``> 0`` (and ``<= at_most`` when given); ``inf`` only with ``allow_inf``."""
    x = number(name, value)
    if x <= 0:
        raise ConfigError(f"{name} must be > 0, got {x:g}")
    if math.isinf(x) and not allow_inf:
        raise ConfigError(f"{name} must be finite, got {x:g}")
    return _at_most(name, x, at_most, "above 0")


def count(name: str, value: object) -> int:
    """A whole number of GPUs, 1 to :data:`MAX_GPUS`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number of GPUs, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    if value > MAX_GPUS:
        raise ConfigError(f"{name} must be at most {MAX_GPUS:,} (valid range: 1 to "
                          f"{MAX_GPUS:,} GPUs), got {value:,}")
    return value


def mttf(name: str, value: object) -> float:
    """A mean time to failure: ``> 0``, ``inf`` meaning no failures."""
    # M = inf (no failures) is legal everywhere; M = 0 would mean failing continuously.
    return positive(name, value, allow_inf=True)


def finite_or_none(x: float | None) -> float | None:
    """``x`` for JSON: ``None`` where it is infinite (or absent)."""
    return x if x is not None and math.isfinite(x) else None
