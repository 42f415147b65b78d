"""torchtitan's checkpoint options with dcp_volumes' own (:class:`VolumeCheckpointConfig`,
``VolumeCheckpointManager.Config``), and :func:`use_volumes`, which switches a trainer's
config to them. See :mod:`dcp_volumes.integrations.torchtitan`.

This module imports torchtitan at its top: only users of torchtitan import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from torchtitan.components.checkpointer.dcp import CheckpointManager

from dcp_volumes import errors

__all__ = ["VolumeCheckpointConfig", "use_volumes"]

_C = TypeVar("_C")


@dataclass(kw_only=True, slots=True)
class VolumeCheckpointConfig(CheckpointManager.Config):
    """torchtitan's checkpoint options, plus where and how dcp_volumes stores the bytes.

    ``folder`` may be any URL dcp_volumes takes (``s3://``, ``gs://``, ``az://``,
    ``file://``, a plain path). ``keep_latest_k`` counts checkpoints that load.
    """

    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    """fsspec options for the folder (endpoint, client settings); set in a config_registry
    function. Credentials are better left to the environment. Never logged."""

    storage_options_json: str = field(default="", repr=False)
    """The same as a JSON object, for the command line; merged over ``storage_options``."""

    keep_every: int = 0
    """With ``keep_latest_k`` > 0: also keep every checkpoint whose step is a multiple of
    this (0: none)."""

    overwrite: bool = False
    """Replace a complete checkpoint at a step that is saved again (atomically: the old
    one stays loadable until the new ``.metadata`` replaces it). Off: such a save raises
    ``CheckpointExistsError`` before any byte moves."""

    spool_mode: Literal["disk", "memory"] = "disk"
    """Where each rank serializes its shards before upload."""

    spool_dir: str = ""
    """Directory for the disk spool (empty: the system temporary directory)."""

    verify: bool = True
    """Check every loaded item against the checksum recorded when it was saved."""

    def __post_init__(self) -> None:
        CheckpointManager.Config.__post_init__(self)
        if self.keep_every < 0:
            raise errors.ConfigError(
                f"checkpoint.keep_every must be >= 0 (0: none), got {self.keep_every}")
        if self.storage_options_json:
            try:
                extra = json.loads(self.storage_options_json)
            except ValueError:
                # the text may hold credentials: never echo it
                raise errors.ConfigError(
                    "checkpoint.storage_options_json is not valid JSON: give an object, "
                    'e.g. \'{"endpoint_url": "http://127.0.0.1:8333"}\'') from None
            if not isinstance(extra, dict):
                raise errors.ConfigError(
                    "checkpoint.storage_options_json must be a JSON object of fsspec "
                    f"options, got a JSON {type(extra).__name__}")

    def fsspec_options(self) -> dict[str, Any]:
        """``storage_options`` with ``storage_options_json`` merged over it."""
        extra = json.loads(self.storage_options_json) if self.storage_options_json else {}
        return {**self.storage_options, **extra}


def use_volumes(config: _C, **options: Any) -> _C:
    """``config`` (a torchtitan ``Trainer.Config``) with its checkpoint manager switched to
    :class:`~dcp_volumes.integrations.torchtitan.VolumeCheckpointManager`, keeping every checkpoint setting it had.

    For a ``--module`` config_registry function::

        def llama3_debug_s3():
            return use_volumes(llama3_debugmodel(), folder="s3://bucket/run-42", enable=True)

    Args:
        config: any object with a ``checkpoint`` field holding a torchtitan checkpoint
            config; it is changed in place and returned.
        options: fields of :class:`VolumeCheckpointConfig` to set (``folder``,
            ``storage_options``, ``keep_every``, ...), over the ones carried over.
    """
    old = config.checkpoint  # type: ignore[attr-defined]
    names = {f.name for f in fields(VolumeCheckpointConfig) if f.init}
    carried = {f.name: getattr(old, f.name) for f in fields(old) if f.init and f.name in names}
    unknown = sorted(set(options) - names)
    if unknown:
        raise errors.ConfigError(
            f"use_volumes() got unknown checkpoint options {unknown}; the options are the "
            f"fields of VolumeCheckpointManager.Config: {sorted(names)}")
    config.checkpoint = VolumeCheckpointConfig(  # type: ignore[attr-defined]
        **{**carried, **options})
    return config
