"""Durations as people write them (``90s``, ``15 min``, ``2h``) and as the CLI prints them."""

from __future__ import annotations

import math
import re

from dcp_volumes.errors import ConfigError

# --------------------------------------------------------------------------------------------
# Durations as people write them


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|hr|d)\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}


def parse_duration_s(text: str) -> float:
    """Seconds in a duration like ``"90s"``, ``"5m"``, ``"1.5h"`` or ``"1d"``.

    The unit is required: a bare ``30`` could mean seconds or minutes.

    Raises:
        ConfigError: Not a positive number followed by s, m, h or d.
    """
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(
            f"cannot read duration {text!r}; write a number and a unit, e.g. 90s, 5m, 1.5h, 1d"
        )
    seconds = float(match.group(1)) * _UNIT_S[match.group(2).lower()]
    if seconds <= 0:
        raise ConfigError(f"duration {text!r} must be greater than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """A short human form: ``"45s"``, ``"5m"``, ``"1h 42m"``, ``"3d 15h"``, ``"inf"``."""
    if math.isinf(seconds):
        return "inf"
    if seconds < 60:
        return f"{seconds:.3g}s"
    s = round(seconds)
    for big, big_u, small, small_u in (
        (86400, "d", 3600, "h"),
        (3600, "h", 60, "m"),
        (60, "m", 1, "s"),
    ):
        if s >= big:
            whole, rest = divmod(s, big)
            part = round(rest / small)
            if part * small == big:  # rounding carried into the larger unit
                whole, part = whole + 1, 0
            return f"{whole}{big_u}" + (f" {part}{small_u}" if part else "")
    return f"{s}s"
