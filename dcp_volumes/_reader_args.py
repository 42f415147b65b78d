"""``VolumeReader``'s keyword arguments, each checked with a message that says what to change."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from dcp_volumes import errors, tier
from dcp_volumes.config import LocalTierOptions

__all__ = ["checked_cooperative", "checked_local_commit", "checked_local_tier",
           "checked_safe_globals", "checked_timeout"]


def checked_safe_globals(value: Any) -> tuple[Any, ...]:
    """``safe_globals=``: a sequence of classes/functions (not a string)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise errors.ConfigError(
            "safe_globals= must be a list of classes/functions (as for "
            f"torch.serialization.add_safe_globals), got {type(value).__name__}")
    return tuple(value)


def checked_cooperative(value: Any) -> bool | Literal["auto"]:
    """``cooperative=``: True, False or ``"auto"``."""
    if value not in (True, False, "auto"):
        raise errors.ConfigError(f"cooperative= must be True, False or 'auto', got {value!r}")
    return value  # type: ignore[no-any-return]


def checked_timeout(value: Any) -> float:
    """``cooperative_timeout_s=``: a finite number of seconds > 0."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise errors.ConfigError(
            f"cooperative_timeout_s= must be a number of seconds > 0, got {value!r}")
    return float(value)


def checked_local_tier(value: Any, *, verify: bool) -> LocalTierOptions | None:
    """``local_tier=``: a LocalTierOptions or None, and only with ``verify=True``."""
    if value is not None and not isinstance(value, LocalTierOptions):
        raise errors.ConfigError(
            f"local_tier= must be a LocalTierOptions or None, got {type(value).__name__}")
    if value is not None and not verify:
        raise errors.ConfigError(
            "local_tier= needs verify=True: local copies are used only when every byte "
            "can be checked against the committed manifest")
    return value


def checked_local_commit(value: Any) -> tier.LocalCommit | None:
    """``local_commit=``: a LocalCommit (a local-only save found in the tier) or None."""
    if value is not None and not isinstance(value, tier.LocalCommit):
        raise errors.ConfigError(
            "local_commit= must be a LocalCommit (from a local-only save found in the "
            f"local tier) or None, got {type(value).__name__}")
    return value
