"""Small helpers every part of the catalog shares: step patterns, counts, file kinds, times."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from dcp_volumes import _layout, errors
from dcp_volumes.backends import Backend, StoreLocation
from dcp_volumes.config import RetryOptions

__all__ = [
    "DEFAULT_STEP_PATTERN",
    "Progress",
    "check_count",
    "compile_step_pattern",
    "step_of",
]

#: Matches ``step-<N>``, ``step_<N>`` and ``<N>`` (the whole directory name).
DEFAULT_STEP_PATTERN = r"^(?:step[-_])?(?P<step>\d+)$"

#: ``progress(done, total)``: bytes verified or objects removed so far, out of ``total``.
Progress = Callable[[int, int], None]

TORCH_SHARD_RE = re.compile(r"^__\d+_\d+\.distcp$")
TMP_RE = re.compile(r"^\.metadata(?:\..+)?\.tmp$")


def open_root(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> Backend:
    """The backend of a run root or checkpoint URL (both checked once, as every location is:
    :class:`~dcp_volumes.backends.StoreLocation`), with the default retry policy."""
    return StoreLocation.parse(url, storage_options).open(RetryOptions())


def compile_step_pattern(step_pattern: str | re.Pattern[str] | None) -> re.Pattern[str]:
    """The compiled step pattern (default :data:`DEFAULT_STEP_PATTERN`).

    Raises:
        ConfigError: ``step_pattern`` is not a valid regular expression.
    """
    if step_pattern is None:
        step_pattern = DEFAULT_STEP_PATTERN
    if isinstance(step_pattern, re.Pattern):
        return step_pattern
    try:
        return re.compile(step_pattern)
    except re.error as exc:
        raise errors.ConfigError(
            f"step pattern {step_pattern!r} is not a valid regular expression ({exc}); "
            r"use e.g. '^step-(?P<step>\d+)$'"
        ) from None


def step_of(name: str, pattern: re.Pattern[str]) -> int | None:
    """The step in a checkpoint's directory name: the group named ``step``, else the first
    group, else the whole match; ``None`` when the name does not match."""
    m = pattern.search(name)
    if m is None:
        return None
    if "step" in pattern.groupindex:
        text = m.group("step")
    elif pattern.groups:
        text = m.group(1)
    else:
        text = m.group(0)
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def check_count(name: str, value: int | None) -> None:
    """Reject anything but ``None`` or a whole number >= 1 (``keep_last``, ``keep_every``).

    Raises:
        ConfigError: naming the option and the value given.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise errors.ConfigError(f"{name} must be a whole number >= 1 or None, got {value!r}")


def save_id_time(save_id: str | None) -> float | None:
    """When a save started, from its id (the first 8 hex digits are epoch seconds)."""
    if save_id is None or not _layout.is_save_id(save_id):
        return None
    return float(int(save_id[:8], 16))


def save_id_in(name: str) -> str | None:
    """The save id in the name of a shard, manifest or live record written by dcp_volumes."""
    return _layout.save_id_of(name) or _layout.live_save_id_of(name)


def is_artifact(name: str) -> bool:
    """A file DCP (torch's writers or ours) writes into a checkpoint directory."""
    return (
        name == _layout.METADATA
        or save_id_in(name) is not None
        or TORCH_SHARD_RE.match(name) is not None
        or TMP_RE.match(name) is not None
    )
